"""Graph rewrites: a run of ops replaced by what a function computes from the same inputs.

``splice(graph, ops, fn, module)`` traces ``fn`` on the ops' inputs (meta tensors, as
capture does), converts its calls to ops with signatures, and rewires every reader of
the replaced ops' results to ``fn``'s. The graph it is given stays as it was (plans,
tuners and schedules may share it): the result is a copy. A module schedule's
``replace(fn, subgraph)`` and ``decompose()`` are written with it.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from chronotope.errors import CaptureError
from chronotope.graph.convert import Converter, Leaf, is_random
from chronotope.graph.ir import Graph, Op, PTensor, Source, TensorKind
from chronotope.graph.registry import map_leaves
from chronotope.graph.trace import Call, Tracer


def reads(ops: Sequence[Op]) -> list[PTensor]:
    """What a run of ops reads from outside it, in the order its ops first read them: the
    arguments a function that replaces it takes."""
    made = {t for op in ops for t in op.outputs}
    return list(dict.fromkeys(t for op in ops for t in op.inputs if t not in made))


def boundary(graph: Graph, ops: Sequence[Op]) -> tuple[list[PTensor], list[PTensor]]:
    """What a run of ops reads from outside it (``reads``) and what of its results is read
    outside it (or is the loss, or a buffer's new value)."""
    inside = set(ops)
    inputs = reads(ops)
    readers = graph.consumers()
    kept = {graph.loss, *graph.buffer_updates.values()}
    outputs = [t for op in ops for t in op.outputs
               if t in kept or any(r not in inside for r in readers.get(t, ()))]
    return inputs, outputs


def splice(graph: Graph, ops: Sequence[Op], fn: Callable[..., Any], module: str,
           source: Source | None = None) -> Graph:
    """A copy of ``graph`` where ``ops`` are replaced by ``fn(*inputs)``, which must return
    their outputs (``boundary``), one tensor or a tuple of them, of the same shapes and
    dtypes. The new ops belong to ``module`` and come from ``source`` (default: the
    lines of ``fn``); they may not draw random numbers, nor may the replaced ones (each
    draw has its place in the counter stream)."""
    names = {op.name for op in ops}
    copied = copy.deepcopy(graph, memo={id(graph.registry): graph.registry})
    ops = [op for op in copied.ops if op.name in names]
    if len(ops) != len(names):
        missing = sorted(names - {op.name for op in ops})
        raise CaptureError(f"{graph.name} has no op {missing[0]!r} to replace")
    for op in ops:
        if is_random(op):
            raise CaptureError(f"{op.name} ({op.kind}) draws random numbers: a rewrite would "
                               "shift every later draw; leave it out of the replaced ops")
    inputs, outputs = boundary(copied, ops)
    if not outputs:
        raise CaptureError(f"nothing outside {_span(ops)} reads what it makes: there is "
                           "nothing to replace")
    new, results = _trace(copied, fn, inputs, module, source)
    _check(ops, outputs, results, fn)
    replaced = dict(zip(outputs, results))
    sub = lambda x: replaced.get(x, x) if isinstance(x, PTensor) else x  # noqa: E731
    gone = set(ops)
    rest = [op for op in copied.ops if op not in gone]
    for op in rest:
        if any(t in replaced for t in op.inputs):
            op.args, op.kwargs = map_leaves(op.args, sub), map_leaves(op.kwargs, sub)
            op.inputs = tuple(sub(t) for t in op.inputs)
    first = copied.ops.index(ops[0])
    copied.ops = _topological(rest[:first] + new + rest[first:], ops)
    copied.loss = sub(copied.loss)
    copied.buffer_updates = {n: sub(t) for n, t in copied.buffer_updates.items()}
    return copied


def _trace(graph: Graph, fn: Callable[..., Any], inputs: list[PTensor], module: str,
           given: Source | None) -> tuple[list[Op], list[PTensor]]:
    """``fn``'s ops on ``inputs`` (named and annotated as capture would) and its results."""
    names = [f"x{i}" for i in range(len(inputs))]
    metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in inputs]
    root = Call(fn, names)
    if any(True for _ in root.parameters()) or any(True for _ in root.buffers()):
        raise CaptureError(f"{_label(fn)} has parameters or buffers of its own: a rewrite "
                           "reads only the replaced ops' inputs (replace the whole module "
                           "to bring new parameters)")
    tracer = Tracer(dict(zip(names, metas)), graph.registry)
    try:
        traced = tracer.trace(root)
    except Exception as e:
        given = ", ".join(f"{t.name}: {t.meta}" for t in inputs)
        raise CaptureError(f"{_label(fn)} fails on the inputs it is given, in order "
                           f"({given}): {type(e).__name__}: {e}") from e
    conv = Converter(graph.registry, graph.name, "fx")
    conv.tensor_names = {t.name for op in graph.ops for t in (*op.inputs, *op.outputs)}
    conv.tensor_names.update(t.name for t in graph.inputs)
    conv.op_names = {op.name for op in graph.ops}
    for name, meta, t in zip(names, metas, inputs):
        conv.leaves[name] = (meta, t)
        conv.current[id(meta)] = t
    conv.alive.extend(metas)

    def constant(node: Any) -> Leaf:
        value = tracer.root
        for part in node.target.split("."):
            value = getattr(value, part)
        return Leaf(f"{module.replace('.', '_')}_{node.target}".strip("_"),
                    TensorKind.CONSTANT, value)

    def source(node: Any) -> Source | None:
        at = given or node.meta.get("source")
        return Source(at.file, at.line, at.function, module) if at else \
            Source("<rewrite>", 0, _label(fn), module)

    result = conv.evaluate(traced, placeholder=lambda n: Leaf(n.target, TensorKind.INPUT, None),
                           get_attr=constant, source=source)
    values = list(result) if isinstance(result, (tuple, list)) else [result]
    found = [conv.current.get(id(v)) if isinstance(v, torch.Tensor) else None for v in values]
    if any(t is None for t in found):
        raise CaptureError(f"{_label(fn)} must return tensors (one, or a tuple of them)")
    for op in conv.ops:
        if is_random(op):
            raise CaptureError(f"{_label(fn)} draws random numbers ({op.kind}); a rewrite "
                               "may not (each draw has its place in the counter stream)")
    graph.constants.update(conv.constants)
    return conv.ops, found


def _check(ops: list[Op], outputs: list[PTensor], results: list[PTensor],
           fn: Callable[..., Any]) -> None:
    want = ", ".join(f"{t.name}: {t.meta}" for t in outputs)
    if len(results) != len(outputs):
        raise CaptureError(f"{_label(fn)} returns {len(results)} tensors; {_span(ops)} makes "
                           f"{len(outputs)} that are read after it ({want})")
    for old, got in zip(outputs, results):
        if old.meta != got.meta:
            raise CaptureError(f"{_label(fn)} returns {got.meta} where {_span(ops)} makes "
                               f"{old.name}: {old.meta}; they must agree ({want})")


def _topological(ops: list[Op], replaced: list[Op]) -> list[Op]:
    """``ops`` in an order where every op follows what it reads, as close to the given
    order as that allows; refused when the replaced ops were not one closed run (an op
    outside them reads one of their results and feeds another)."""
    position = {op: i for i, op in enumerate(ops)}
    makers = {t: op for op in ops for t in op.outputs}
    waits = {op: {makers[t] for t in op.inputs if t in makers} for op in ops}
    readers: dict[Op, list[Op]] = {}
    for op, before in waits.items():
        for b in before:
            readers.setdefault(b, []).append(op)
    ready = [(position[op], id(op), op) for op, before in waits.items() if not before]
    heapq.heapify(ready)
    out: list[Op] = []
    while ready:
        _, _, op = heapq.heappop(ready)
        out.append(op)
        for r in readers.get(op, ()):
            waits[r].discard(op)
            if not waits[r]:
                heapq.heappush(ready, (position[r], id(r), r))
    if len(out) != len(ops):
        raise CaptureError(f"{_span(replaced)} is not one closed run of ops: an op outside it "
                           "reads one of its results and feeds another of its ops; replace "
                           "a run that ends before anything outside reads it")
    return out


def _span(ops: Sequence[Op]) -> str:
    return ops[0].name if len(ops) == 1 else f"{ops[0].name}..{ops[-1].name}"


def _label(fn: Callable[..., Any]) -> str:
    return type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, "__name__", repr(fn))
