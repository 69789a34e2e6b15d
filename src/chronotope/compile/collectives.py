"""Rewriting point-to-point patterns into collectives.

Materialization speaks only in sends and receives. When every rank of a set
sums the same region from one piece on each of them, those k·(k-1) messages
are one all-reduce. Collectives must be called in the same order on every
member, so the rewrite is applied only when the ranks' orders agree.
"""

from __future__ import annotations

import graphlib
from collections import defaultdict

from chronotope.compile.program import AllReduce, Assemble, Instruction, Recv, Send, reads


def all_reduces(ranks: list[list[Instruction]]) -> tuple[list[list[Instruction]], list]:
    """Replace all-reduce patterns; returns the new code and the rank sets used."""
    found: dict[tuple, list[tuple[int, Assemble]]] = defaultdict(list)
    for rank, code in enumerate(ranks):
        for ins in code:
            if isinstance(ins, Assemble) and ins.sum_of_pieces is not None:
                s = ins.sum_of_pieces
                found[(s.tensor, s.region, s.sources)].append((rank, ins))
    chosen: dict[int, tuple[int, ...]] = {}  # id(Assemble) -> ranks
    for (_, _, sources), members in found.items():
        member_ranks = tuple(sorted(r for r, _ in members))
        if len(members) > 1 and member_ranks == tuple(sorted({r for _, r in sources})):
            for _, ins in members:
                chosen[id(ins)] = member_ranks
    if not chosen or not _same_order(ranks, chosen):
        return ranks, []
    out = []
    for code in ranks:
        new: list[Instruction] = []
        for ins in code:
            if id(ins) in chosen:
                p = ins.sum_of_pieces
                new.append(AllReduce((ins.var,), (p.local,), chosen[id(ins)], (ins.shape,),
                                     ins.dtype, ((p.tensor, p.region, p.sources),)))
            else:
                new.append(ins)
        out.append(new)
    return coalesce(_drop_unread_messages(out)), sorted(set(chosen.values()))


def coalesce(ranks: list[list[Instruction]]) -> list[list[Instruction]]:
    """Back-to-back all-reduces over the same ranks and dtype become one flat buffer,
    where they are back to back on every member rank (so all members merge alike)."""
    adjacent: dict[tuple, set[int]] = defaultdict(set)  # (key a, key b) -> ranks
    for rank, code in enumerate(ranks):
        for a, b in zip(code, code[1:]):
            if isinstance(a, AllReduce) and isinstance(b, AllReduce):
                adjacent[(a.keys[-1], b.keys[0])].add(rank)
    out = []
    for code in ranks:
        merged: list[Instruction] = []
        for ins in code:
            prev = merged[-1] if merged else None
            if (isinstance(ins, AllReduce) and isinstance(prev, AllReduce)
                    and prev.ranks == ins.ranks and prev.dtype == ins.dtype
                    and adjacent[(prev.keys[-1], ins.keys[0])] == set(ins.ranks)):
                merged[-1] = AllReduce(prev.vars + ins.vars, prev.srcs + ins.srcs, prev.ranks,
                                       prev.shapes + ins.shapes, prev.dtype,
                                       prev.keys + ins.keys)
            else:
                merged.append(ins)
        out.append(merged)
    return out


def _same_order(ranks: list[list[Instruction]], chosen: dict[int, tuple[int, ...]]) -> bool:
    """Whether one global order of the collectives agrees with every rank's order."""
    key = {}
    for code in ranks:
        for ins in code:
            if id(ins) in chosen:
                s = ins.sum_of_pieces
                key[id(ins)] = (s.tensor, s.region, s.sources)
    order = graphlib.TopologicalSorter()
    for code in ranks:
        mine = [key[id(ins)] for ins in code if id(ins) in chosen]
        for a, b in zip(mine, mine[1:]):
            order.add(b, a)
    try:
        order.prepare()
    except graphlib.CycleError:
        return False
    return True


def _drop_unread_messages(ranks: list[list[Instruction]]) -> list[list[Instruction]]:
    """Receives nobody reads any more, and their sends."""
    read = [{var for ins in code for var in reads(ins)} for code in ranks]
    dead = {(r, ins.tag) for r, code in enumerate(ranks) for ins in code
            if isinstance(ins, Recv) and ins.var not in read[r]}
    return [
        [ins for ins in code
         if not (isinstance(ins, Recv) and (rank, ins.tag) in dead)
         and not (isinstance(ins, Send) and (ins.dst, ins.tag) in dead)]
        for rank, code in enumerate(ranks)
    ]
