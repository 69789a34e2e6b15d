"""Signatures of custom ``torch.autograd.Function`` ops, read off their forward.

A Function is one op of the graph, run with its own forward and backward, so capture
keeps no ops inside it to split. Its forward still says which dims it treats
independently: tracing it on meta tensors gives ops with signatures, and a dim of an
input that every one of those ops splits alike (never reduced, never read whole) down
to a dim of an output splits the Function too. An elementwise Function (Bloom's GeLU, a
straight-through round, a gradient reversal) then splits along every dim. Its backward
is trusted to treat those dims as independently as its forward; a Function registered
with ``@chronotope.register_op`` keeps the signature given.
"""

from __future__ import annotations

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
        text = _composed(ops, ins, outs)
        if text is None:
            return None
        sig = Signature.parse(text)
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


def _composed(ops: list[Op], ins: list[PTensor], outs: list[PTensor]) -> str | None:
    """One signature for the run of ``ops`` from ``ins`` to ``outs``: tensor axes tied by a
    splittable dim of some op are one dim; a dim any op reduces or freezes is frozen, and
    so is one that no output has."""
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

    def dims(t: PTensor, prefix: str) -> str:
        return " ".join(name.get(root((t, a)), f"{prefix}{a}^") if t.shape[a] != 1 else "1"
                        for a in range(len(t.shape))) or "()"

    return (", ".join(dims(t, f"i{k}_") for k, t in enumerate(ins)) + " -> "
            + ", ".join(dims(t, f"o{k}_") for k, t in enumerate(outs)))
