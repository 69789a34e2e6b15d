"""Gradient reductions in buckets, each started as soon as its gradients are made.

Materialized, a rank sums its parameters' gradients with the other replicas after
its whole backward, in one all-reduce. Here those sums are cut into buckets of at
most ``bucket_bytes`` in the order the backward makes the gradients, and each
bucket's all-reduce is placed right after the backward piece that makes its last
gradient, so it runs while the rest of the backward does (as DDP's buckets do); a
reduce-scatter of gradients (ZeRO) moves up the same way. Placed before the
backward pieces are fused into autograd regions, a bucket also ends the region it
falls in. The members of a group must call its collectives in one order: where
they would not make the same buckets, or the moved code would not run through,
their reductions stay where they were.
"""

from __future__ import annotations

import math
from collections import defaultdict

from chronotope.compile.program import AllReduce, Instruction, ReduceScatter, reads, writes
from chronotope.compile.replay import replay

BUCKET_MB = 25.0  # DDP's default bucket size


def buckets(ranks: list[list[Instruction]], bucket_bytes: float = BUCKET_MB * 2**20,
            ) -> list[list[Instruction]]:
    """Every rank's code with its gradient reductions bucketed and moved up."""
    entries: dict[tuple[int, ...], dict[int, list[tuple]]] = defaultdict(dict)
    for rank, code in enumerate(ranks):
        made = {var: i for i, ins in enumerate(code) for var in writes(ins)}
        read: dict[str, int] = {}
        for i, ins in reversed(list(enumerate(code))):
            read.update((var, i) for var in reads(ins))
        found: dict[tuple[int, ...], list[tuple]] = defaultdict(list)
        for at, ins in enumerate(code):
            for entry in _gradient_sums(ins):
                ready = max(made.get(v, at) for v in entry[-1])
                found[ins.ranks].append((ready, *entry, read.get(entry[0].var, len(code))))
        for group, items in found.items():
            entries[group][rank] = sorted(items, key=lambda e: e[0])
    moves: list[dict[int, list[Instruction]]] = [defaultdict(list) for _ in ranks]
    moved: list[set[int]] = [set() for _ in ranks]
    for group, per_rank in entries.items():
        orders = {tuple(e[1].key_of for e in items) for items in per_rank.values()}
        if len(per_rank) != len(group) or len(orders) != 1:
            continue  # the members would not make the same buckets
        for rank, items in per_rank.items():
            for at, ins in _bucketed(items, group, bucket_bytes):
                moves[rank][at].append(ins)
            moved[rank] |= {id(e[1].instruction) for e in items}
    out = [[x for i, ins in enumerate(code) if id(ins) not in moved[rank]
            for x in (ins, *moves[rank].get(i, ()))] for rank, code in enumerate(ranks)]
    if all(_in_order(code) for code in out) and replay(out).runs_through:
        return out
    return ranks


def _in_order(code: list[Instruction]) -> bool:
    """Whether every tensor read is made before (or never made here: a leaf)."""
    made = {var: i for i, ins in enumerate(code) for var in writes(ins)}
    return all(made.get(var, -1) < i for i, ins in enumerate(code) for var in reads(ins))


class _Sum:
    """One gradient sum of a reduction instruction: what it makes, from what."""

    def __init__(self, instruction: Instruction, index: int) -> None:
        self.instruction, self.index = instruction, index
        ins = instruction
        self.key_of = ins.keys[index] if isinstance(ins, AllReduce) else ins.key
        self.var = ins.vars[index] if isinstance(ins, AllReduce) else ins.var


def _gradient_sums(ins: Instruction) -> list[tuple[_Sum, tuple[str, ...]]]:
    """The gradient sums an all-reduce or reduce-scatter makes (none if it sums anything
    else: a loss's count, a forward partial sum)."""
    if isinstance(ins, AllReduce) and _gradients(ins.keys):
        return [(_Sum(ins, i), srcs) for i, srcs in enumerate(ins.srcs)]
    if isinstance(ins, ReduceScatter) and _gradients((ins.key,)):
        return [(_Sum(ins, 0), ins.srcs)]
    return []


def _gradients(keys: tuple[tuple, ...]) -> bool:
    return bool(keys) and all(k and str(k[0]).startswith("grad(") for k in keys)


def _bucketed(items: list[tuple], group: tuple[int, ...], bucket_bytes: float,
              ) -> list[tuple[int, Instruction]]:
    """(where, instruction): the reductions of ``items`` (by readiness), all-reduces in
    buckets of at most ``bucket_bytes``, each after its last gradient is made and before
    any of its sums is read (a sum the backward itself reads ends its bucket)."""
    out: list[tuple[int, Instruction]] = []
    bucket: list[tuple] = []
    size = 0.0

    def close() -> None:
        nonlocal bucket, size
        if bucket:
            first = bucket[0][1].instruction
            out.append((bucket[-1][0], AllReduce(
                tuple(e[1].instruction.vars[e[1].index] for e in bucket),
                tuple(e[2] for e in bucket), group,
                tuple(e[1].instruction.shapes[e[1].index] for e in bucket), first.dtype,
                tuple(e[1].key_of for e in bucket))))
        bucket, size = [], 0.0

    for item in items:
        ready, entry, _, _ = item
        ins = entry.instruction
        if isinstance(ins, ReduceScatter):
            out.append((ready, ins))
            continue
        nbytes = math.prod(ins.shapes[entry.index]) * ins.dtype.itemsize
        if bucket and (size + nbytes > bucket_bytes or ready >= min(e[3] for e in bucket)
                       or bucket[0][1].instruction.dtype != ins.dtype):
            close()
        bucket.append(item)
        size += nbytes
    close()
    return out
