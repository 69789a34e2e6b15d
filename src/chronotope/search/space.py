"""The search space: for every op, the ways to cut it over ``n`` devices, from its signature.

A strategy is an algorithm (``Split(dim, n)`` of a splittable dim, or ``Replicate(n)``)
with what it implies, read off the pieces ``partition`` makes, exactly as ``Plan.trans``
would cut them: the layout of every input and output over the devices (``R`` whole on
each, ``P`` partial sums, ``S<a>`` sliced along axis ``a``) and of every input's
gradient; its compute time (forward and backward) per device. What joins two strategies
is priced by the layout change between them under the cluster's alpha-beta model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from chronotope.cost.compute import op_flops
from chronotope.cost.network import Cluster
from chronotope.errors import ChronotopeError
from chronotope.graph.ir import Graph, Op, PTensor
from chronotope.graph.mask import Mask, VTensor
from chronotope.graph.ops import DEFAULT_REGISTRY
from chronotope.graph.registry import OpRegistry
from chronotope.plan.algo import Algorithm, Piece, Replicate, Split, ValueSplit, partition
from chronotope.plan.plan import Plan

WHOLE, PARTIAL, IRREGULAR = "R", "P", "?"
TRAINING_FLOPS = 3.0  # a backward costs twice its forward


@dataclass(frozen=True)
class Strategy:
    algo: Algorithm
    inputs: tuple[str, ...]  # layout of each input as the pieces read it
    outputs: tuple[str, ...]
    grads: tuple[str, ...]  # layout of each input's gradient as the backward pieces yield it
    compute: float  # seconds per device, forward and backward

    @property
    def label(self) -> str:
        if isinstance(self.algo, Split):
            return f"split {self.algo.dim}"
        return "value split" if isinstance(self.algo, ValueSplit) else "replicate"


def nbytes(t: PTensor) -> int:
    return math.prod(t.shape) * t.dtype.itemsize


def strategies(graph: Graph, n: int, cluster: Cluster,
               registry: OpRegistry | None = None) -> dict[Op, list[Strategy]]:
    """Every op's strategies over ``n`` devices (at least ``Replicate(n)``)."""
    registry = registry or DEFAULT_REGISTRY
    scratch = Plan(graph, n, registry=registry)  # the whole-op pieces Plan.trans starts from
    peak = cluster.peak()
    out: dict[Op, list[Strategy]] = {}
    seen: dict[tuple, list[Strategy]] = {}  # ops alike (repeated layers') are cut alike
    for op in graph.ops:
        alike = (id(op.target), op.kind, str(op.signature), tuple(map(tuple, op.input_shapes)),
                 tuple(t.shape for t in op.outputs),
                 None if op.region is None else tuple(b - a for a, b in op.region))
        if alike in seen:
            out[op] = seen[alike]
            continue
        piece = scratch.roots[op.name].piece
        opdef = registry.of(op.target)
        additive = opdef.additive_inputs if opdef is not None else ()
        linear = opdef.linear_in(len(op.inputs)) if opdef is not None else ()
        algos: list[Algorithm] = [Replicate(n)]
        if op.signature is not None and n > 1:
            algos += [Split(d, n) for d in op.signature.splittable()]
        if linear and n > 1:
            algos.append(ValueSplit(n))  # a mean loss: each piece its share of the sum
        found = []
        for algo in algos:
            try:
                pieces = partition(op.name, op.signature, piece, algo, additive, linear)
            except ChronotopeError:
                continue  # a dim that does not divide, or one this op cannot cut
            made = _strategy(op, algo, piece, pieces, n, peak)
            if made is not None and all(lay != IRREGULAR for lay in made.outputs):
                found.append(made)
        out[op] = seen[alike] = found
    return out


def _strategy(op: Op, algo: Algorithm, whole: Piece, pieces: list[Piece], n: int,
              peak: float) -> Strategy | None:
    if len(pieces) != n:
        return None
    inputs = tuple(_layout([p.inputs[k] for p in pieces], whole.inputs[k].mask)
                   for k in range(len(op.inputs)))
    outputs = tuple(_layout([p.outputs[k] for p in pieces], whole.outputs[k].mask)
                    for k in range(len(op.outputs)))
    grads = tuple(_grad_layout(lay, [p.grad_shares[k] if k < len(p.grad_shares) else None
                                     for p in pieces])
                  for k, lay in enumerate(inputs))
    parts = 1 if isinstance(algo, Replicate) else n
    return Strategy(algo, inputs, outputs, grads, TRAINING_FLOPS * op_flops(op) / parts / peak)


def _layout(views: list[VTensor], full: Mask) -> str:
    """How the pieces hold what the whole op reads of a tensor (``full``: all of it, or
    the region a view op takes): whole, partial sums, or sliced along one axis."""
    masks = [v.mask for v in views]
    if all(m.index == full.index for m in masks):
        if all(m.value.is_full for m in masks):
            return WHOLE
        return PARTIAL if len({m.value for m in masks}) == len(masks) else IRREGULAR
    if any(not m.value.is_full for m in masks):
        return IRREGULAR
    axes = {a for m in masks for a, (rng, whole) in enumerate(zip(m.index, full.index))
            if rng != whole}
    if len(axes) != 1:
        return IRREGULAR
    axis = axes.pop()
    starts = [m.index[axis][0] for m in masks]
    return f"S{axis}" if starts == sorted(starts) and len(set(starts)) == len(starts) \
        else IRREGULAR


def _grad_layout(read: str, shares: list) -> str:
    """The gradient of an input read with layout ``read``: sliced as read, or partial
    where the pieces each yield a share of it (an input read whole by cut pieces)."""
    if read.startswith("S"):
        return read
    if any(s is not None and not s.is_full for s in shares):
        return PARTIAL
    return WHOLE


def change_seconds(src: str, dst: str, size: int, n: int, cluster: Cluster) -> float:
    """Seconds to turn a tensor of ``size`` bytes held as ``src`` into ``dst`` on ``n``
    devices (one collective; free where each device already holds what it needs)."""
    if src == dst or n == 1 or dst == PARTIAL and src == WHOLE:
        return 0.0  # a value share of a whole tensor is a local scale
    group = [tuple(range(n))]
    if dst.startswith("S") and src == WHOLE:
        return 0.0  # a local slice
    if src == PARTIAL:
        kind = "reduce_scatter" if dst.startswith("S") else "all_reduce"
        return cluster.collective(kind, size, group)
    if src.startswith("S") and dst.startswith("S"):
        return cluster.collective("all_to_all", size / n, group)  # each holds its slice
    return cluster.collective("all_gather", size, group)  # sliced -> whole or partial


def repeated(graph: Graph, space: dict[Op, list[Strategy]]) -> dict[Op, tuple]:
    """Ops of repeated layers (``h.0.attn``, ``h.1.attn``, ...) keyed alike where they are
    the same op: the same kind, code line, signature, shapes and strategies. One decision
    then serves every layer, as a hand-written plan treats them."""
    keys: dict[Op, tuple] = {}
    for op in graph.ops:
        module = op.source.module if op.source else ""
        layer = re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", module)
        if layer == module or not space.get(op):
            continue
        keys[op] = (layer, op.kind, op.source.line if op.source else None,
                    str(op.signature), tuple(map(tuple, op.input_shapes)),
                    tuple(t.shape for t in op.outputs), op.region is not None,
                    tuple((s.algo, s.inputs, s.outputs, s.grads) for s in space[op]))
    return keys
