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
from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from chronotope.graph.convert import Converter, Leaf
from chronotope.graph.ir import DEVICE, Graph, Op, PTensor, TensorKind
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
        kept = {d for d in names if _backward_agrees(op, dims, d)}
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
        it = iter(tensors)

        def real(x: Any) -> Any:
            if isinstance(x, PTensor):
                return next(it)
            return torch.device("meta") if x is DEVICE else x

        args, kwargs = map_leaves(op.args, real), map_leaves(op.kwargs, real)
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


def _backward_agrees(op: Op, dims: list[list[str | None]], name: str) -> bool:
    """Whether the Function's own forward and backward, run on random inputs in two pieces
    along ``name``, give the whole run's outputs and input gradients: its backward treats
    the dim as independently as its forward does (a backward that sums over the batch,
    say, does not)."""
    function = autograd_function(op.target)
    nin = len(op.inputs)
    if sum(math.prod(t.shape) for t in op.inputs) > _CHECK_UP_TO:
        return False
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
             if t.dtype.is_floating_point else torch.zeros(t.shape, dtype=t.dtype)
             for t in op.inputs]
    grads_out = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
                 for t in op.outputs]

    def run(values: list[torch.Tensor], grads: list[torch.Tensor]):
        leaves = [v.detach().requires_grad_(v.is_floating_point()) for v in values]
        it = iter(leaves)
        args = map_leaves(op.args, lambda x: next(it) if isinstance(x, PTensor) else
                          torch.device("cpu") if x is DEVICE else x)
        kwargs = map_leaves(op.kwargs, lambda x: next(it) if isinstance(x, PTensor) else
                            torch.device("cpu") if x is DEVICE else x)
        outs = function.apply(*args, **kwargs)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        floats = [x for x in leaves if x.requires_grad]
        got = torch.autograd.grad(
            [o for o in outs if o.requires_grad], floats,
            [g for o, g in zip(outs, grads) if o.requires_grad], allow_unused=True)
        found = iter(got)
        return [o.detach() for o in outs], [next(found) if x.requires_grad else None
                                            for x in leaves]

    def piece(t: torch.Tensor, axes: list[str | None], k: int) -> torch.Tensor:
        a = axes.index(name) if name in axes else None
        if a is None:
            return t
        half = t.shape[a] // 2
        return t.narrow(a, 0, half) if k == 0 else t.narrow(a, half, t.shape[a] - half)

    try:
        outs, grads = run(whole, grads_out)
        pieces = [run([piece(v, dims[j], k) for j, v in enumerate(whole)],
                      [piece(g, dims[nin + j], k) for j, g in enumerate(grads_out)])
                  for k in (0, 1)]
    except Exception:
        return False
    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5)

    for j, axes in enumerate(dims[nin:]):  # outputs: the pieces' side by side, or each whole
        got = [p[0][j] for p in pieces]
        if not (close(torch.cat(got, axes.index(name)), outs[j]) if name in axes
                else all(close(g, outs[j]) for g in got)):
            return False
    for j, axes in enumerate(dims[:nin]):  # gradients: side by side, or partial sums
        if grads[j] is None:
            continue
        got = [p[1][j] if p[1][j] is not None else torch.zeros_like(piece(grads[j], axes, k))
               for k, p in enumerate(pieces)]
        joined = torch.cat(got, axes.index(name)) if name in axes else got[0] + got[1]
        if not close(joined, grads[j]):
            return False
    return True
