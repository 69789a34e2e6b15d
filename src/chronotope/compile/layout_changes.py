"""Layout changes the compiler makes by a searched RVD path instead of per-reader messages.

For every tensor, the pieces its producers write and the pieces its readers
read fall into groups that overlap only among themselves (one micro-batch, one
stage boundary). Where a group's producers form an RVD layout of its box and its
readers another, and the cheapest path between them (``rvd_search``) takes
more than one step and beats plain messages under the cost model, the path
becomes the group's communication: each rank runs its part of every step right
after it made its last piece of the group (or, if it made none, right before it
first reads one). A single step is left to the pattern matching in
``collectives``, which finds the same collective. Readers of value parts keep
the per-reader assembly: their share of a value is part of what they
differentiate.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache

import torch

from chronotope.compile.program import (
    AllGather,
    AllReduce,
    AllToAll,
    Assemble,
    Instruction,
    Key,
    Part,
    Recv,
    ReduceScatter,
    Send,
)
from chronotope.compile.rvd import Layout
from chronotope.compile.rvd_search import Path, Step, p2p, search
from chronotope.cost.network import Cluster
from chronotope.errors import PlanError
from chronotope.graph.ir import PTensor
from chronotope.graph.mask import BoxIndex, Mask
from chronotope.plan.plan import PlanOp, placed

MAX_STATES = 2000  # per search: a compiler must not stall on one tensor


@dataclass(frozen=True)
class Change:
    """One group of a tensor: its producers, its readers, and the path between them."""

    tensor: PTensor
    box: Mask
    producers: tuple[tuple[PlanOp, Mask], ...]
    readers: tuple[tuple[int, Mask], ...]
    path: Path

    @property
    def key(self) -> tuple:
        return ("rvd", self.tensor.name, self.box.index)


def find_changes(sequences: dict[int, list[PlanOp]], cluster: Cluster,
                 skip: frozenset = frozenset()) -> list[Change]:
    """The groups worth a searched path, with the path."""
    made: dict[PTensor, list[tuple[PlanOp, Mask]]] = defaultdict(list)
    read: dict[PTensor, dict[tuple[int, Mask], None]] = defaultdict(dict)
    for rank, seq in sequences.items():
        for op in seq:
            for v in op.outputs:
                made[v.ptensor].append((op, v.mask))
            if not op.weight:
                for v in op.inputs:
                    read[v.ptensor][(rank, v.mask)] = None
    out = []
    for t, readers in read.items():
        local = {(op.device, m) for op, m in made.get(t, ())}
        if all(r in local for r in readers):
            continue  # every reader made its own piece: nothing moves
        for producers, group in _groups(made[t], list(readers)):
            change = _change(t, producers, group, cluster)
            if change is not None and change.key not in skip:
                out.append(change)
    return out


def _groups(producers: list[tuple[PlanOp, Mask]], readers: list[tuple[int, Mask]]):
    """Producers and readers joined by overlapping regions, group by group."""
    parent = list(range(len(producers) + len(readers)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    boxes = BoxIndex([r.index for _, r in readers])
    values = [(float(r.value.lo), float(r.value.hi)) for _, r in readers]
    for i, (_, m) in enumerate(producers):
        lo, hi = float(m.value.lo), float(m.value.hi)
        for j in boxes.overlapping(m.index):  # Mask.overlaps, without Fractions
            if values[j][0] < hi and lo < values[j][1]:
                parent[root(i)] = root(len(producers) + j)
    groups: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
    for i, p in enumerate(producers):
        groups[root(i)][0].append(p)
    for j, r in enumerate(readers):
        groups[root(len(producers) + j)][1].append(r)
    return [g for g in groups.values() if g[0] and g[1]]


def _change(t: PTensor, producers: list, readers: list, cluster: Cluster) -> Change | None:
    ranks = {op.device for op, _ in producers} | {r for r, _ in readers}
    if len(ranks) < 2 or any(not m.value.is_full for _, m in readers):
        return None
    box = Mask(tuple((min(m.index[d][0] for _, m in producers),
                      max(m.index[d][1] for _, m in producers)) for d in range(len(t.shape))))
    if not all(box.contains(Mask(m.index)) for _, m in readers):
        return None  # read beyond what this group's producers make
    src = _layout([(op.device, m) for op, m in producers], box)
    dst = _layout(list(readers), box)
    if src is None or dst is None:
        return None
    shape = box.shape
    if max((*src.devices, *dst.devices)) >= cluster.ndevices:
        return None  # the cost model has no price for it
    path = _search(src, dst, shape, t.dtype.itemsize, cluster)
    if path is None or len(path.steps) < 2:
        return None
    return Change(t, box, tuple(producers), tuple(readers), path)


def _layout(pieces: list[tuple[int, Mask]], box: Mask) -> Layout | None:
    if len({d for d, _ in pieces}) != len(pieces):
        return None  # two pieces on one device: not one RVD
    shifted = [(d, Mask(tuple((a - lo, b - lo) for (a, b), (lo, _) in zip(m.index, box.index)),
                        m.value)) for d, m in pieces]
    return Layout.of(shifted, box.shape)


def _search(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int,
            cluster: Cluster) -> Path | None:
    """The searched path, when it beats plain messages. The cluster's nodes are alike, so
    a change between devices whole nodes further on (the next pipeline stages') is the
    same path moved: each is searched from the first node."""
    by = cluster.node(min(*src.devices, *dst.devices)) * cluster.per_node
    path = _searched(src.moved(-by), dst.moved(-by), shape, itemsize, cluster)
    return path.moved(by) if path is not None and by else path


@lru_cache(maxsize=4096)
def _searched(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int,
              cluster: Cluster) -> Path | None:
    try:
        path = search(src, dst, shape, itemsize, cluster, max_states=MAX_STATES)
    except PlanError:
        return None
    naive = p2p(src, dst, shape, itemsize, cluster)
    return path if path.seconds < naive.seconds * (1 - 1e-6) else None


# ---- instructions ------------------------------------------------------------------------------


class Emitter:
    """Each rank's instructions for a path, named and tagged by the materializer."""

    def __init__(self, name, next_tag) -> None:
        self.name = name  # (rank, hint, shape) -> a fresh local name
        self.next_tag = next_tag  # () -> a fresh message tag

    def emit(self, path: Path, name: str, dtype: torch.dtype, shape: tuple[int, ...],
             key: Key, inputs: dict[int, str],
             ) -> tuple[dict[int, list[Instruction]], dict[int, str]]:
        """Per rank, its instructions taking tensor ``name``'s pieces (``inputs``: their names)
        of a box of ``shape`` along ``path``, and the name of each reader's piece at the end;
        ``key`` names the path's collectives."""
        code: dict[int, list[Instruction]] = defaultdict(list)
        held = dict(inputs)  # rank -> name of its current piece
        for i, step in enumerate(path.steps):
            if step.kind == "send":
                held = self._messages(step, held, name, dtype, shape, code)
                continue
            after = dict(step.after.pieces(shape))
            new = {}
            for group in step.groups:
                for g, rank in enumerate(group):
                    out_shape = after[rank].shape
                    x = held[rank]
                    if step.kind == "zeros" and g == 0:
                        new[rank] = x
                        continue
                    out = self.name(rank, f"{name}_{step.kind}", out_shape)
                    before = dict(step.before.pieces(shape))[rank].shape
                    code[rank].append(_collective(step, replace(key, via=(*key.via, i, group)),
                                                  group, g, x, out,
                                                  out_shape, dtype, before))
                    new[rank] = out
            held = new
        return code, held

    def _messages(self, step: Step, held: dict[int, str], name: str, dtype: torch.dtype,
                  shape, code: dict[int, list[Instruction]]) -> dict[int, str]:
        before, after = dict(step.before.pieces(shape)), dict(step.after.pieces(shape))
        parts: dict[int, list[Part]] = defaultdict(list)
        for m in step.messages:
            box = Mask(m.box)
            src_slices = box.local_slices(Mask(before[m.src].index))
            if m.src == m.dst:
                parts[m.dst].append(Part(held[m.src], src_slices,
                                         box.local_slices(Mask(after[m.dst].index)), Fraction(1)))
                continue
            tag = self.next_tag()
            var = self.name(m.dst, f"{name}_from{m.src}", box.shape)
            code[m.src].append(Send(held[m.src], src_slices, m.dst, tag))
            code[m.dst].append(Recv(var, box.shape, dtype, m.src, tag))
            whole = tuple(slice(0, n) for n in box.shape)
            parts[m.dst].append(Part(var, whole, box.local_slices(Mask(after[m.dst].index)),
                                     Fraction(1)))
        new = {}
        for rank, mask in after.items():
            out = self.name(rank, name, mask.shape)
            code[rank].append(Assemble(out, mask.shape, dtype, parts.get(rank, [])))
            new[rank] = out
        return new


def _collective(step: Step, key: Key, group: tuple[int, ...], g: int, x: str, out: str,
                out_shape: tuple[int, ...], dtype: torch.dtype, in_shape: tuple[int, ...],
                ) -> Instruction:
    if step.kind == "all_reduce":
        return AllReduce((out,), ((x,),), group, (out_shape,), dtype, (key,))
    if step.kind == "all_gather":
        return AllGather((out,), (x,), group, (out_shape,), dtype, (step.dims[0],), (key,))
    if step.kind == "reduce_scatter":
        return ReduceScatter((out,), ((x,),), group, (out_shape,), dtype, (step.dims[0],),
                             (key,))
    if step.kind == "all_to_all":
        cat, split = step.dims
        return AllToAll(out, x, group, group, out_shape, dtype, cat, split, key)
    if step.kind == "chunk":
        run = in_shape[step.dims[0]] // len(group)
        src = tuple(slice(g * run, (g + 1) * run) if d == step.dims[0] else slice(0, n)
                    for d, n in enumerate(in_shape))
        return Assemble(out, out_shape, dtype,
                        [Part(x, src, tuple(slice(0, n) for n in out_shape), Fraction(1))])
    if step.kind == "zeros":
        return Assemble(out, out_shape, dtype, [])
    raise PlanError(f"unknown layout step {step.kind!r}")


def placement(change: Change, position: dict[PlanOp, int],
              sequences: dict[int, list[PlanOp]]) -> dict[int, tuple[str, PlanOp]] | None:
    """Where each rank runs its part: ("post", its last producer) or ("pre", its first
    reader); None when a rank would have to read before it has made its pieces."""
    last: dict[int, PlanOp] = {}
    for op, _ in change.producers:
        device = placed(op)
        if device not in last or position[op] > position[last[device]]:
            last[device] = op
    wanted = {(r, m.index) for r, m in change.readers}
    first: dict[int, PlanOp] = {}
    for rank in {r for r, _ in change.readers}:
        first[rank] = next(op for op in sequences[rank] if not op.weight and any(
            v.ptensor is change.tensor and (rank, v.mask.index) in wanted for v in op.inputs))
    where = {}
    for rank in set(change.path.src.devices) | set(change.path.dst.devices):
        if rank in last:
            if rank in first and position[first[rank]] <= position[last[rank]]:
                return None
            where[rank] = ("post", last[rank])
        else:
            where[rank] = ("pre", first[rank])
    return where

