"""The search space: for every op, the ways to cut it over a device mesh, from its signature.

A mesh is a tuple of axis sizes (``(8,)``, or ``(nodes, per_node)``), devices numbered
row-major. A strategy is one algorithm per mesh axis (``Split(dim, n)`` of a splittable
dim, ``ValueSplit(n)`` or ``Replicate(n)``), nested as ``build`` nests them, with what it
implies, read off the pieces ``partition`` makes exactly as ``Plan.trans`` would cut them:
the layout of every input and output on each axis (``R`` whole, ``P`` partial sums,
``S<a>`` sliced along tensor axis ``a``) and of every input's gradient; its compute time
(forward and backward) per device. Data parallelism, Megatron's column and row splits,
sequence parallelism and their products on two axes are all points of this space. What
joins two strategies is priced by the layout change between them under the cluster's
alpha-beta model, axis by axis.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatch

from chronotope.compile.rvd import PARTIAL, REPLICATE, is_shard, shard
from chronotope.cost.compute import Traffic, op_flops
from chronotope.cost.network import Cluster
from chronotope.errors import ChronotopeError
from chronotope.graph.ir import Graph, Op, PTensor, TensorKind
from chronotope.graph.mask import Mask, ValueRange, VTensor
from chronotope.graph.ops import DEFAULT_REGISTRY
from chronotope.graph.registry import OpRegistry
from chronotope.plan.algo import Algorithm, Piece, Replicate, Split, ValueSplit, partition
from chronotope.plan.plan import Plan
from chronotope.search.constraints import ConstraintError

IRREGULAR = "?"  # pieces no placement describes
TRAINING_FLOPS = 3.0  # a backward costs twice its forward

Placements = tuple[str, ...]  # per mesh axis: R, P or S(<dim>) (compile.rvd)


@dataclass(frozen=True)
class Mesh:
    """Devices as a grid: ``shape[0]`` the outermost axis (across nodes, where it spans them)."""

    shape: tuple[int, ...]

    @property
    def devices(self) -> int:
        return math.prod(self.shape)

    def groups(self, axis: int) -> list[tuple[int, ...]]:
        """The device groups along ``axis``, all of which run an axis collective at once."""
        stride = math.prod(self.shape[axis + 1:])
        others = [range(n) if a != axis else range(1) for a, n in enumerate(self.shape)]
        out = []
        for index in itertools.product(*others):
            first = sum(i * math.prod(self.shape[a + 1:]) for a, i in enumerate(index))
            out.append(tuple(first + k * stride for k in range(self.shape[axis])))
        return out

    def __str__(self) -> str:
        return "x".join(map(str, self.shape))


def meshes(devices: int, per_node: int | None = None) -> list[Mesh]:
    """The meshes searched over ``devices``: one axis, and two axes whose inner one has
    2, 4, 8... devices, within a node (``per_node``) where one is given: tensor
    parallelism inside a node, data parallelism across (``(16, 8)`` on DGX nodes)."""
    inner = [k for k in (2 ** i for i in range(1, devices.bit_length()))
             if devices % k == 0 and k < devices and (per_node is None or k <= per_node)]
    return [Mesh((devices,)), *(Mesh((devices // k, k)) for k in inner)]


@dataclass(frozen=True)
class Strategy:
    algos: tuple[Algorithm, ...]  # one per mesh axis, outermost first
    inputs: tuple[Placements, ...]  # each input's layout as the pieces read it
    outputs: tuple[Placements, ...]
    grads: tuple[Placements, ...]  # each input's gradient as the backward pieces yield it
    compute: float  # seconds per device, forward and backward
    zero: bool = False  # the weights it reads first: updates cut over the devices (ZeRO)

    @property
    def label(self) -> str:
        text = " x ".join(algo_label(a) for a in self.algos)
        return text + " + zero" if self.zero else text


def algo_label(algo: Algorithm) -> str:
    if isinstance(algo, Split):
        return f"split {algo.dim}"
    return "value split" if isinstance(algo, ValueSplit) else "replicate"


def nbytes(t: PTensor) -> int:
    return math.prod(t.shape) * t.dtype.itemsize


def sharded(layout: Placements, mesh: Mesh) -> int:
    """Into how many slices a tensor held as ``layout`` is cut (its per-device fraction)."""
    return math.prod(n for lay, n in zip(layout, mesh.shape) if is_shard(lay))


def strategies(graph: Graph, mesh: Mesh | int, cluster: Cluster,
               registry: OpRegistry | None = None, whole: Plan | None = None,
               dtype: str = "fp32") -> dict[Op, list[Strategy]]:
    """Every op's strategies over ``mesh`` (at least replicating it on every axis), their
    compute at the cluster's FLOP rate for ``dtype``.
    ``whole``: a one-device plan of the graph, whose whole-op pieces ``Plan.trans`` starts
    from (made here if not given; a caller searching many meshes makes it once)."""
    mesh = Mesh((mesh,)) if isinstance(mesh, int) else mesh
    registry = registry or graph.registry or DEFAULT_REGISTRY
    scratch = whole if whole is not None else Plan(graph, 1, registry=registry)
    traffic = Traffic(graph, dtype)

    def seconds(op: Op, inputs: list[float], outputs: list[float], flops: float) -> float:
        return cluster.compute(flops, traffic.forward(op, inputs, outputs), dtype)
    out: dict[Op, list[Strategy]] = {}
    seen: dict[tuple, list[Strategy]] = {}  # ops alike (repeated layers') are cut alike
    for op in graph.ops:
        alike = (id(op.target), op.kind, str(op.signature), tuple(map(tuple, op.input_shapes)),
                 tuple(t.shape for t in op.outputs),
                 None if op.region is None else tuple(b - a for a, b in op.region),
                 tuple(t.kind for t in op.inputs), tuple(t.frozen for t in op.inputs))
        if alike not in seen:
            seen[alike] = _op_strategies(op, scratch.roots[op.name].piece, mesh, registry,
                                         seconds)
        out[op] = seen[alike]
    return out


def constrain(graph: Graph, space: dict[Op, list[Strategy]],
              constraints: dict[str, str] | None) -> dict[Op, list[Strategy]]:
    """``space`` where each op whose name or module matches a pattern of ``constraints``
    (``kind:<kind>``: whose op kind does) keeps the strategies it allows, shell-style:
    ``"split b*"`` cuts every mesh axis along a batch dim, ``"replicate"`` none; ``"split
    b0 x split n"`` names each axis' cut. ZeRO's cut of the update is allowed either way.
    Ops alike keep one list, as ``repeated`` needs."""
    if not constraints:
        return space
    out, kept = dict(space), {}
    for pattern, allowed in constraints.items():
        matched = [op for op in graph.ops if space.get(op) and _selects(pattern, op)]
        if not matched:
            raise ConstraintError(f"the constraint {pattern!r} matches no op or module of "
                                  f"{graph.name!r} that a plan cuts")
        for op in matched:
            key = (id(out[op]), allowed)
            if key not in kept:
                kept[key] = [s for s in out[op] if _allows(allowed, s)]
            if not kept[key]:
                labels = ", ".join(sorted({s.label for s in out[op]}))
                raise ConstraintError(f"the constraint {pattern!r}: {allowed!r} leaves op "
                                      f"{op.name} no strategy; it has: {labels}")
            out[op] = kept[key]
    return out


def _selects(pattern: str, op: Op) -> bool:
    if pattern.startswith("kind:"):
        return fnmatch(op.kind, pattern[len("kind:"):])
    return fnmatch(op.name, pattern) or bool(op.source and fnmatch(op.source.module, pattern))


def _allows(allowed: str, s: Strategy) -> bool:
    labels = [algo_label(a) for a in s.algos]
    if " x " in allowed:
        return fnmatch(" x ".join(labels), allowed)
    return all(fnmatch(label, allowed) for label in labels)


def _op_strategies(op: Op, whole: Piece, mesh: Mesh, registry: OpRegistry,
                   seconds: Callable) -> list[Strategy]:
    opdef = registry.of(op.target)
    additive = opdef.additive_inputs if opdef is not None else ()
    linear = opdef.linear_in(len(op.inputs)) if opdef is not None else ()
    splits = op.signature.splittable() if op.signature is not None else []
    found = []
    for algos in itertools.product(*(_algos(n, splits, bool(linear)) for n in mesh.shape)):
        if not _divides(whole, algos):
            continue
        levels, piece = [], whole
        try:
            for algo in algos:  # the layouts, read off as few pieces as show them
                pieces = partition(op.name, op.signature, piece, _fewest(algo), additive,
                                   linear)
                levels.append((piece, pieces))
                piece = pieces[0]
        except ChronotopeError:
            continue  # a dim that does not divide, or one this op cannot cut
        made = _strategy(op, algos, levels, seconds)
        if made is not None:
            found.append(made)
            if _zero_applies(op, made):
                found.append(_with_zero(made))
    return found


def _divides(whole: Piece, algos: tuple[Algorithm, ...]) -> bool:
    """Whether each split's dim divides into its parts, level after level."""
    sizes = dict(whole.sizes)
    for a in algos:
        if isinstance(a, Split) and a.dim in sizes:  # an unknown dim: partition says so
            if sizes[a.dim] % a.parts:
                return False
            sizes[a.dim] //= a.parts
    return True


def _fewest(algo: Algorithm) -> Algorithm:
    """The same cut into its smallest prime number of parts: a dim that divides into
    ``n`` parts divides into any factor of ``n``, and the layouts are the same (read off
    two pieces rather than a thousand)."""
    n = algo.n if isinstance(algo, Replicate) else algo.parts
    p = next((k for k in range(2, math.isqrt(n) + 1) if n % k == 0), n)
    if isinstance(algo, Replicate):
        return Replicate(p)
    return Split(algo.dim, p) if isinstance(algo, Split) else ValueSplit(p)


def _algos(n: int, splits: list[str], linear: bool) -> list[Algorithm]:
    if n == 1:
        return [Replicate(1)]
    return [Replicate(n), *(Split(d, n) for d in splits), *([ValueSplit(n)] if linear else [])]


def _strategy(op: Op, algos: tuple[Algorithm, ...], levels: list[tuple[Piece, list[Piece]]],
              seconds: Callable) -> Strategy | None:
    """The layouts, axis by axis: each level's pieces against the piece they were cut from;
    the compute of a device's piece, forward and backward, by ``seconds(op, elements of
    each input, of each output, FLOPs)`` of its forward."""
    inputs: list[list[str]] = [[] for _ in op.inputs]
    outputs: list[list[str]] = [[] for _ in op.outputs]
    grads: list[list[str]] = [[] for _ in op.inputs]
    for parent, pieces in levels:
        for k in range(len(op.inputs)):
            lay = _layout([p.inputs[k] for p in pieces], parent.inputs[k].mask)
            inputs[k].append(lay)
            grads[k].append(_grad_layout(lay, [p.grad_shares[k] if k < len(p.grad_shares)
                                               else None for p in pieces],
                                         parent.grad_shares[k]
                                         if k < len(parent.grad_shares) else None))
        for k in range(len(op.outputs)):
            outputs[k].append(_layout([p.outputs[k] for p in pieces], parent.outputs[k].mask))
    if any(IRREGULAR in lay for lay in outputs):
        return None
    parts = math.prod(a.parts for a in algos if not isinstance(a, Replicate))

    def held(k: int, side: str) -> float:  # elements of a tensor one device's piece holds
        n = float(math.prod((op.inputs if side == "inputs" else op.outputs)[k].shape))
        for (parent, pieces), algo in zip(levels, algos):
            if getattr(pieces[0], side)[k].mask.numel < getattr(parent, side)[k].mask.numel:
                n /= algo.parts  # cut on this axis (read off a few of its parts)
        return n
    compute = seconds(op, [held(k, "inputs") for k in range(len(op.inputs))],
                      [held(k, "outputs") for k in range(len(op.outputs))], op_flops(op) / parts)
    return Strategy(tuple(algos), tuple(map(tuple, inputs)), tuple(map(tuple, outputs)),
                    tuple(map(tuple, grads)), TRAINING_FLOPS * compute)


def _zero_applies(op: Op, s: Strategy) -> bool:
    """A trainable weight the op reads as data parallelism does: its update can be cut
    over the devices (ZeRO-2)."""
    return any(t.kind is TensorKind.PARAM and not t.frozen and data_parallel_read(s, i)
               for i, t in enumerate(op.inputs))


def data_parallel_read(s: Strategy, i: int) -> bool:
    """Whether ``s`` reads input ``i`` as data parallelism does: whole on every device,
    its gradient a partial sum on every axis."""
    return all(lay == REPLICATE for lay in s.inputs[i]) and all(g == PARTIAL for g in s.grads[i])


def _with_zero(s: Strategy) -> Strategy:
    return Strategy(s.algos, s.inputs, s.outputs, s.grads, s.compute, zero=True)


def _layout(views: list[VTensor], full: Mask) -> str:
    """How the pieces hold what their parent (``full``: a whole tensor, the region a view
    op takes, or a piece's slice) holds of a tensor: whole, partial sums, or sliced along
    one axis."""
    masks = [v.mask for v in views]
    if all(m.index == full.index for m in masks):
        if all(m.value == full.value for m in masks):
            return REPLICATE
        return PARTIAL if len({m.value for m in masks}) == len(masks) else IRREGULAR
    if any(m.value != full.value for m in masks):
        return IRREGULAR
    axes = {a for m in masks for a, (rng, whole) in enumerate(zip(m.index, full.index))
            if rng != whole}
    if len(axes) != 1:
        return IRREGULAR
    axis = axes.pop()
    starts = [m.index[axis][0] for m in masks]
    return shard(axis) if starts == sorted(starts) and len(set(starts)) == len(starts) \
        else IRREGULAR


def _grad_layout(read: str, shares: list, parent: ValueRange | None = None) -> str:
    """The gradient of an input read with layout ``read``: sliced as read, or partial
    where the pieces each yield a share of their parent's (an input read whole by cut
    pieces)."""
    if is_shard(read):
        return read
    if any(s is not None and s != (parent if parent is not None else ValueRange.FULL)
           for s in shares):
        return PARTIAL
    return REPLICATE


@dataclass
class Pricer:
    """Seconds of layout changes and gradient reductions on one mesh of one cluster,
    remembered: the ILP asks the same few sizes many times."""

    mesh: Mesh
    cluster: Cluster
    _calls: dict = field(default_factory=dict)  # (kind, bytes, axis, levels) -> seconds
    _changes: dict = field(default_factory=dict)  # (src, dst, bytes) -> seconds

    def collective(self, kind: str, size: float, axis: int, levels: bool = False) -> float:
        """One call over each group of ``axis`` at once; ``levels``: an all-reduce as the
        compiler's layout search emits it, in two levels where that is cheaper (the
        step's gradient reductions are single calls)."""
        key = (kind, size, axis, levels)
        if key not in self._calls:
            groups = self.mesh.groups(axis)
            seconds = self.cluster.collective(kind, size, groups)
            if levels and kind == "all_reduce":
                seconds = min(seconds, self._in_two_levels(size, groups))
            self._calls[key] = seconds
        return self._calls[key]

    def _in_two_levels(self, size: float, groups: list[tuple[int, ...]]) -> float:
        """An all-reduce over groups that span nodes with several members on each, as the
        compiler's layout search emits it where that is cheaper: reduce-scatter within
        each node, all-reduce of the slices across nodes, all-gather within each node."""
        node = self.cluster.node
        inner = [tuple(d for d in g if node(d) == n) for g in groups
                 for n in sorted({node(d) for d in g})]
        k = len(inner[0]) if inner else 0
        if not 1 < k < len(groups[0]) or any(len(g) != k for g in inner):
            return math.inf
        across = [g[i::k] for g in groups for i in range(k)]
        return (self.cluster.collective("reduce_scatter", size, inner)
                + self.cluster.collective("all_reduce", size / k, across)
                + self.cluster.collective("all_gather", size, inner))

    def change(self, src: Placements, dst: Placements, size: int) -> float:
        """Turn a tensor of ``size`` bytes held as ``src`` into ``dst``, one axis at a time
        on the slice the other axes leave each device."""
        key = (src, dst, size)
        if key not in self._changes:
            self._changes[key] = self._change(src, dst, size)
        return self._changes[key]

    def _change(self, src: Placements, dst: Placements, size: int) -> float:
        total = 0.0
        for axis, (s, d) in enumerate(zip(src, dst)):
            n = self.mesh.shape[axis]
            if s == d or n == 1:
                continue
            others = math.prod(m for a, (lay, m) in enumerate(zip(src, self.mesh.shape))
                               if a != axis and is_shard(lay))
            total += self._axis_change(s, d, size / others, axis, n)
        return total

    def _axis_change(self, src: str, dst: str, size: float, axis: int, n: int) -> float:
        if dst == PARTIAL and src == REPLICATE or is_shard(dst) and src == REPLICATE:
            return 0.0  # a value share or a slice of a whole tensor: local
        if src == PARTIAL:
            kind = "reduce_scatter" if is_shard(dst) else "all_reduce"
            return self.collective(kind, size, axis, levels=True)
        if is_shard(src) and is_shard(dst):
            return self.collective("all_to_all", size / n, axis)  # each holds its slice
        return self.collective("all_gather", size, axis)  # sliced -> whole or partial

    def reduction(self, grads: Placements, read: Placements, size: int) -> float:
        """A weight gradient's share of the all-reduces that sum a step's gradients at once
        over each axis it is partial on: its bytes' time, the call's latency aside."""
        total = 0.0
        for axis, g in enumerate(grads):
            if g == PARTIAL and self.mesh.shape[axis] > 1:
                others = math.prod(m for a, (lay, m) in enumerate(zip(read, self.mesh.shape))
                                   if a != axis and is_shard(lay))
                total += self.collective("all_reduce", size / others, axis) - \
                    self.collective("all_reduce", 0, axis)
        return total

    def zero_calls(self, grads: Placements) -> float:
        """A weight updated in pieces is summed and gathered on its own, not in the step's
        one all-reduce: two calls' latency per axis (the bytes are an all-reduce's)."""
        return sum(self.collective("reduce_scatter", 0, a) + self.collective("all_gather", 0, a)
                   for a, g in enumerate(grads) if g == PARTIAL and self.mesh.shape[a] > 1)


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
                    id(space[op]))
    return keys
