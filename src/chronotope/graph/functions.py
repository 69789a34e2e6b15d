"""Signatures of custom ``torch.autograd.Function`` ops, read off their forward.

A Function is one op of the graph, run with its own forward and backward, so capture
keeps no ops inside it to split. Its forward still says which dims it may treat
independently: tracing it on meta tensors gives ops with signatures, and a dim of an
input that every one of those ops splits alike (never reduced, never read whole) down
to a dim of an output is a candidate. Its backward is the user's own, so each candidate
is then tried: the Function runs forward and backward on random inputs whole and in two
pieces along the dim, and only a dim whose pieces give the whole run's outputs and input
gradients splits. An elementwise Function (Bloom's GeLU, a straight-through round, a
gradient reversal) splits along every dim; one whose backward sums over the batch does
not split the batch. Inputs too large to try stay whole (register a signature with
``@chronotope.register_op`` on the class, which is kept as given).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from chronotope.graph.convert import Converter, Leaf
from chronotope.graph.ir import DEVICE, Graph, Op, PTensor, TensorKind, takes_grad
from chronotope.graph.registry import OpRegistry, autograd_function, map_leaves
from chronotope.graph.signature import Signature
from chronotope.graph.trace import Call, Tracer

_DEPTH = 3  # Functions whose forward calls Functions, followed this deep


def sign_functions(graph: Graph) -> None:
    """Give each Function op of ``graph`` without a signature the one its forward has."""
    for op in graph.ops:
        if op.signature is None and autograd_function(op.target) is not None:
            op.signature = derived(op, graph.registry)
            if op.signature is not None:
                op.note = ""


def derived(op: Op, registry: OpRegistry | None, depth: int = 0) -> Signature | None:
    """The signature of Function op ``op`` from its forward's ops, or None when the forward
    cannot be traced on meta tensors or splits nothing."""
    if registry is None or depth > _DEPTH:
        return None
    try:
        ops, ins, outs = _forward_ops(op, registry)
        for inner in ops:
            if inner.signature is None and autograd_function(inner.target) is not None:
                inner.signature = derived(inner, registry, depth + 1)
        dims = _composed(ops, ins, outs)
        if dims is None:
            return None
        names = {d for axes in dims for d in axes if d not in (None, "1")}
        trial = _Trial.of(op)
        kept = {d for d in names if trial is not None and trial.agrees(dims, d)}
        if not kept:
            return None
        sig = Signature.parse(_text(dims, len(op.inputs), kept))
        sig.bind([t.shape for t in op.inputs], [t.shape for t in op.outputs])
        return sig
    except Exception:  # a forward meta tensors cannot run: the op stays replicate-only
        return None


def _forward_ops(op: Op, registry: OpRegistry) -> tuple[list[Op], list[PTensor], list[PTensor]]:
    """The forward of ``op``'s Function traced on meta tensors of its inputs' shapes: its
    ops, the tensors standing for the op's inputs, and those it returns."""
    function = autograd_function(op.target)
    names = [f"x{i}" for i in range(len(op.inputs))]
    metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in op.inputs]
    own_ctx = function.setup_context is torch.autograd.Function.setup_context

    def forward(*tensors: torch.Tensor) -> Any:
        args, kwargs = _arguments(op, tensors, torch.device("meta"))
        if not own_ctx:  # forward(*args), then setup_context(ctx, inputs, output)
            return function.forward(*args, **kwargs)
        ctx = FunctionCtx()
        ctx.needs_input_grad = tuple(isinstance(a, torch.Tensor) for a in args)
        return function.forward(ctx, *args, **kwargs)

    tracer = Tracer(dict(zip(names, metas)), registry)
    traced = tracer.trace(Call(forward, names))
    conv = Converter(registry, op.name, "fx")
    meta = dict(zip(names, metas))
    result = conv.evaluate(
        traced, placeholder=lambda n: Leaf(n.target, TensorKind.INPUT, meta[n.target]),
        get_attr=lambda n: Leaf(n.target, TensorKind.CONSTANT, getattr(tracer.root, n.target)),
        source=lambda n: None)
    values = list(result) if isinstance(result, (tuple, list)) else [result]
    outs = [conv.current[id(v)] for v in values if isinstance(v, torch.Tensor)]
    return conv.ops, list(conv.batch), outs


def _arguments(op: Op, tensors: Sequence[torch.Tensor], device: torch.device
               ) -> tuple[tuple, dict]:
    """``op``'s arguments with ``tensors`` for its inputs, in order, on ``device``."""
    it = iter(tensors)

    def real(x: Any) -> Any:
        if isinstance(x, PTensor):
            return next(it)
        return device if x is DEVICE else x

    return map_leaves(op.args, real), map_leaves(op.kwargs, real)


def _composed(ops: list[Op], ins: list[PTensor], outs: list[PTensor]
              ) -> list[list[str | None]] | None:
    """One signature's dims for the run of ``ops`` from ``ins`` to ``outs``, per tensor
    (the inputs', then the outputs') the name of each axis: tensor axes tied by a
    splittable dim of some op are one dim; a dim any op reduces or freezes has no name,
    nor has one that no output has."""
    parent: dict[tuple[PTensor, int], tuple[PTensor, int]] = {}

    def root(p: tuple[PTensor, int]) -> tuple[PTensor, int]:
        while parent.get(p, p) != p:
            p = parent[p]
        return p

    frozen: set[tuple[PTensor, int]] = set()
    for op in ops:
        sig = op.signature
        if sig is None:
            return None
        named: dict[str, list[tuple[PTensor, int]]] = defaultdict(list)
        for tensors, dims in ((op.inputs, sig.inputs), (op.outputs, sig.outputs)):
            for k, (t, axes) in enumerate(zip(tensors, dims)):
                for a, axis in enumerate(axes):
                    boxed = op.region is not None and tensors is op.inputs and k == 0 \
                        and op.region[a] != (0, t.shape[a])
                    (f,) = axis.factors if len(axis.factors) == 1 else (None,)
                    if f is not None and f.size is not None:
                        continue  # a size-1 axis: broadcast, nothing to split
                    if f is None or boxed or not f.splittable or f.reduce:
                        frozen.add((t, a))
                    else:
                        named[f.name].append((t, a))
        for positions in named.values():
            first = root(positions[0])
            for p in positions[1:]:
                parent[root(p)] = first
    frozen = {root(p) for p in frozen}
    made = {root((t, a)) for t in outs for a in range(len(t.shape))}
    read = {root((t, a)) for t in ins for a in range(len(t.shape))}
    free = (made & read) - frozen
    name = {r: f"s{i}" for i, r in enumerate(sorted(free, key=str))}
    if not name:
        return None
    return [[name.get(root((t, a))) if t.shape[a] != 1 else "1" for a in range(len(t.shape))]
            for t in (*ins, *outs)]


def _text(dims: list[list[str | None]], ninputs: int, kept: set[str]) -> str:
    """The signature over ``dims`` (per tensor, its axes' dim names, None: no name), with
    only the names in ``kept`` splittable; the rest frozen, each under its own name."""
    def tensor(k: int, axes: list[str | None]) -> str:
        side = f"i{k}" if k < ninputs else f"o{k - ninputs}"
        return " ".join(d if d == "1" or d in kept else f"{side}_{a}^"
                        for a, d in enumerate(axes)) or "()"

    parts = [tensor(k, axes) for k, axes in enumerate(dims)]
    return ", ".join(parts[:ninputs]) + " -> " + ", ".join(parts[ninputs:])


_CHECK_UP_TO = 1 << 22  # elements of a Function's inputs its backward is checked on


@dataclass
class _Trial:
    """A Function op run whole on random inputs and output gradients, against which runs
    in two pieces along a dim are compared: its backward treats that dim as independently
    as its forward does, or not (a backward that sums over the batch, say)."""

    op: Op
    inputs: list[torch.Tensor]
    grads_out: list[torch.Tensor]
    outs: list[torch.Tensor]
    grads: list[torch.Tensor | None]

    @classmethod
    def of(cls, op: Op) -> _Trial | None:
        """The whole run, or None for inputs too large to try or a Function that fails."""
        if sum(math.prod(t.shape) for t in op.inputs) > _CHECK_UP_TO:
            return None
        gen = torch.Generator().manual_seed(0)
        inputs = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
                  if t.dtype.is_floating_point else torch.zeros(t.shape, dtype=t.dtype)
                  for t in op.inputs]
        grads_out = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
                     for t in op.outputs]
        try:
            return cls(op, inputs, grads_out, *_run(op, inputs, grads_out))
        except Exception:
            return None

    def agrees(self, dims: list[list[str | None]], name: str) -> bool:
        """Whether runs in two pieces along ``name`` give the whole run's outputs and input
        gradients (``dims``: each tensor's dim names, the inputs' then the outputs')."""
        nin = len(self.op.inputs)

        def piece(t: torch.Tensor, axes: list[str | None], k: int) -> torch.Tensor:
            if name not in axes:
                return t
            a = axes.index(name)
            half = t.shape[a] // 2
            return t.narrow(a, 0, half) if k == 0 else t.narrow(a, half, t.shape[a] - half)

        try:
            pieces = [_run(self.op, [piece(v, dims[j], k) for j, v in enumerate(self.inputs)],
                           [piece(g, dims[nin + j], k) for j, g in enumerate(self.grads_out)])
                      for k in (0, 1)]
        except Exception:
            return False
        for j, axes in enumerate(dims[nin:]):  # outputs: the pieces' side by side, or whole
            got = [p[0][j] for p in pieces]
            if not (_close(torch.cat(got, axes.index(name)), self.outs[j]) if name in axes
                    else all(_close(g, self.outs[j]) for g in got)):
                return False
        for j, axes in enumerate(dims[:nin]):  # gradients: side by side, or partial sums
            if self.grads[j] is None:
                continue
            got = [p[1][j] if p[1][j] is not None else
                   torch.zeros_like(piece(self.grads[j], axes, k)) for k, p in enumerate(pieces)]
            joined = torch.cat(got, axes.index(name)) if name in axes else got[0] + got[1]
            if not _close(joined, self.grads[j]):
                return False
        return True


def _run(op: Op, values: Sequence[torch.Tensor], grads_out: Sequence[torch.Tensor]
         ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The Function's outputs on ``values`` and its input gradients for ``grads_out``."""
    leaves = [v.detach().requires_grad_(takes_grad(v.dtype)) for v in values]
    args, kwargs = _arguments(op, leaves, torch.device("cpu"))
    outs = autograd_function(op.target).apply(*args, **kwargs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    floats = [x for x in leaves if x.requires_grad]
    got = iter(torch.autograd.grad(
        [o for o in outs if o.requires_grad], floats,
        [g for o, g in zip(outs, grads_out) if o.requires_grad], allow_unused=True))
    return [o.detach() for o in outs], [next(got) if x.requires_grad else None for x in leaves]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5)
