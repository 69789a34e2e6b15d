"""Frees: each local tensor is freed right after the last instruction that reads it.

Guarantees: a ``Free`` after each tensor's last reader (what forwards made again
inside a backward call, freed inside it after their last reader there); nothing
else changes, so it runs last.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from chronotope.compile.program import Backward, Free, Instruction, reads, writes


def with_frees(code: list[Instruction]) -> list[Instruction]:
    """Insert ``Free`` after the last instruction that reads each tensor."""
    last: dict[str, int] = {}
    for i, ins in enumerate(code):
        for var in reads(ins):
            last[var] = i
    frees: dict[int, list[str]] = defaultdict(list)
    for var, i in last.items():
        frees[i].append(var)
    out: list[Instruction] = []
    for i, ins in enumerate(code):
        if isinstance(ins, Backward) and ins.recompute:
            ins = _freed_inside(ins, {v for v in _writes_inside(ins) if last.get(v, -1) <= i})
        out.append(ins)
        if frees.get(i):
            out.append(Free(tuple(frees[i])))
    return out


def _writes_inside(ins: Backward) -> list[str]:
    return [v for f in ins.recompute for v in writes(f)]


def _freed_inside(ins: Backward, unread: set[str]) -> Backward:
    """``ins`` freeing what its forwards run again make as soon as they are done with it
    (nothing after the call reads it): after the last of them that reads it."""
    last = {v: k for k, f in enumerate(ins.recompute) for v in (*writes(f), *reads(f))}
    frees: list[list[str]] = [[] for _ in ins.recompute]
    for v in dict.fromkeys(_writes_inside(ins)):
        if v in unread:
            frees[last[v]].append(v)
    return replace(ins, frees=tuple(tuple(f) for f in frees))
