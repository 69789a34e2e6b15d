"""Gradient reductions in buckets, each started as soon as its gradients are made.

Materialized, a rank sums its parameters' gradients with the other replicas after
its whole backward, in one all-reduce. Here those sums are cut into buckets of at
most ``bucket_bytes`` in the order the backward makes the gradients, and each
bucket's all-reduce is placed right after the backward piece that makes its last
gradient, so it runs while the rest of the backward does (as DDP's buckets do). The
reduce-scatters of gradients (ZeRO) are bucketed and moved up the same way, a bucket
in one flat call (as FSDP's reduce-scatter per parameter group). Placed before the
backward pieces are fused into autograd regions, a bucket also ends the region it
falls in. The members of a group must call its collectives in one order: where
they would not make the same buckets, or the moved code would not run through,
their reductions stay where they were.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from chronotope.compile.program import (
    AllReduce,
    Instruction,
    Key,
    Loss,
    ReduceScatter,
    flat,
    reads,
    sums_gradients,
    writes,
)
from chronotope.compile.replay import replay

BUCKET_MB = 25.0  # DDP's default bucket size


def buckets(ranks: list[list[Instruction]], bucket_bytes: float = BUCKET_MB * 2**20,
            check: bool = True) -> list[list[Instruction]]:
    """Every rank's code with its gradient reductions bucketed and moved up; with
    ``check``, only if it still runs through (else as it was), without, the caller's to
    check."""
    sums: dict[tuple[int, ...], dict[int, list[_Sum]]] = defaultdict(dict)
    uses = [_Uses.of(code) for code in ranks]
    for rank, code in enumerate(ranks):
        for group, found in _gradient_sums(code, uses[rank]).items():
            sums[group][rank] = sorted(found, key=lambda e: e.ready)
    moves: list[dict[int, list[Instruction]]] = [defaultdict(list) for _ in ranks]
    moved: list[set[int]] = [set() for _ in ranks]
    for group, per_rank in sums.items():
        orders = {tuple(e.key for e in found) for found in per_rank.values()}
        members = {g % len(ranks) for g in group}  # past the ranks here: their replicas
        if len(per_rank) != len(members) or len(orders) != 1:
            continue  # the members would not make the same buckets
        for rank, found in per_rank.items():
            summed: list[_Sum] = []
            riders: list[_Sum] = []
            for e in found:
                (summed if sums_gradients((e.key,)) else riders).append(e)
            placed = _bucketed(summed, group, bucket_bytes)
            placed, riders = _ride(placed, riders)
            for at, ins in placed:
                moves[rank][at].append(ins)
            moved[rank] |= {id(e.instruction) for e in summed + riders}
    if not all(uses[rank].in_order(placed) for rank, placed in enumerate(moves)):
        return ranks
    out = [[x for i, ins in enumerate(code) if id(ins) not in moved[rank]
            for x in (ins, *moves[rank].get(i, ()))] for rank, code in enumerate(ranks)]
    if not check or replay(out).runs_through:
        return out
    return ranks


@dataclass
class _Uses:
    """Where a rank's code makes each tensor and first reads it, and what more than
    ``Loss`` reads: one scan (the code is long once folded)."""

    made: dict[str, int]
    needed: dict[str, int]
    read_by_others: set[str]

    @staticmethod
    def of(code: list[Instruction]) -> _Uses:
        uses = _Uses({}, {}, set())
        for i, ins in enumerate(code):
            found = reads(ins)
            for var in found:
                uses.needed.setdefault(var, i)
            if not isinstance(ins, Loss):
                uses.read_by_others.update(found)
            for var in writes(ins):
                uses.made[var] = i
        return uses

    def in_order(self, placed: dict[int, list[Instruction]]) -> bool:
        """Whether reductions ``placed`` after the instructions given read what is made
        by then and are placed before what reads them (the rest keeps its order)."""
        return all(self.made.get(var, -1) <= at for at, added in placed.items()
                   for ins in added for var in reads(ins)) and \
            all(self.needed.get(var, at + 1) > at for at, added in placed.items()
                for ins in added for var in writes(ins))


@dataclass(frozen=True)
class _Sum:
    """One gradient sum of a reduction instruction: its gradients are all made by
    instruction ``ready``, and instruction ``needed`` is the first to read the sum."""

    instruction: AllReduce | ReduceScatter
    index: int  # which of the instruction's sums
    ready: int
    needed: int

    @property
    def key(self) -> Key:
        return self.instruction.keys[self.index]


def _gradient_sums(code: list[Instruction], uses: _Uses
                   ) -> dict[tuple[int, ...], list[_Sum]]:
    """By group, the gradient sums this rank's all-reduces and reduce-scatters make, and
    the sums it only reports (the loss, which rides in a gradient bucket: read by nothing
    but ``Loss``, or unread); not those of anything else: a loss's count, a forward
    partial sum."""
    made, needed, read_by_others = uses.made, uses.needed, uses.read_by_others
    out: dict[tuple[int, ...], list[_Sum]] = defaultdict(list)
    for at, ins in enumerate(code):
        if not isinstance(ins, (AllReduce, ReduceScatter)) or not (
                sums_gradients(ins.keys) or isinstance(ins, AllReduce) and all(
                    v in made and v not in read_by_others for v in ins.vars)):
            continue
        if any(isinstance(code[made[v]], (AllReduce, ReduceScatter))
               for srcs in ins.srcs for v in srcs if v in made):
            continue  # sums what another reduction sums (over a scaled plan's replicas)
        for index, (srcs, var) in enumerate(zip(ins.srcs, ins.vars)):
            ready = max(made.get(v, at) for v in srcs)
            out[ins.ranks].append(_Sum(ins, index, ready, needed.get(var, len(code))))
    return out


def _ride(placed: list[tuple[int, Instruction]], riders: list[_Sum]
          ) -> tuple[list[tuple[int, Instruction]], list[_Sum]]:
    """The buckets with the sums the step only reports (the loss) added to the last
    bucket, where it is an all-reduce of their dtype; and the riders that rode (the
    others stay where they were, as ZeRO's last bucket is a reduce-scatter)."""
    if not placed or not riders:
        return placed, []
    last = max(range(len(placed)), key=lambda k: placed[k][0])
    at, bucket = placed[last]
    if not isinstance(bucket, AllReduce):
        return placed, []
    riders = [e for e in riders if e.instruction.dtype == bucket.dtype]
    if riders:
        placed = list(placed)
        placed[last] = (at, flat([*((bucket, k) for k in range(len(bucket.vars))),
                                  *((e.instruction, e.index) for e in riders)]))
    return placed, riders


def _bucketed(found: list[_Sum], group: tuple[int, ...], bucket_bytes: float,
              ) -> list[tuple[int, Instruction]]:
    """(where, instruction): the reductions of ``found`` (by readiness) in buckets of at
    most ``bucket_bytes`` (all-reduces and reduce-scatters apart), each after its last
    gradient is made and before any of its sums is read. A sum the backward itself reads
    before the next one is made goes out then, alone with what is as urgent; the rest
    of its bucket waits to fill (one call at the end, not two, for a small model)."""
    out: list[tuple[int, Instruction]] = []
    bucket: list[_Sum] = []
    size = 0.0  # of the bucket

    def nbytes(e: _Sum) -> float:
        ins = e.instruction
        size = math.prod(ins.shapes[e.index]) * ins.dtype.itemsize
        return size * len(group) if isinstance(ins, ReduceScatter) else size  # all sent

    def close(entries: list[_Sum]) -> None:
        if entries:
            out.append((max(e.ready for e in entries),
                        flat([(e.instruction, e.index) for e in entries])))

    soonest = math.inf  # the first read of any of the bucket's sums
    for entry in found:
        ins = entry.instruction
        if bucket and (type(bucket[0].instruction) is not type(ins)
                       or bucket[0].instruction.dtype != ins.dtype):
            close(bucket)
            bucket, size, soonest = [], 0.0, math.inf
        if soonest <= entry.ready:
            urgent = [e for e in bucket if e.needed <= entry.ready]
            close(urgent)
            bucket = [e for e in bucket if e.needed > entry.ready]
            size = sum(map(nbytes, bucket))
            soonest = min((e.needed for e in bucket), default=math.inf)
        if bucket and size + nbytes(entry) > bucket_bytes:
            close(bucket)
            bucket, size, soonest = [], 0.0, math.inf
        bucket.append(entry)
        size += nbytes(entry)
        soonest = min(soonest, entry.needed)
    close(bucket)
    return out
