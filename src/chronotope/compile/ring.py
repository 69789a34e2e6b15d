"""Ring attention: keys and values gathered for query chunks land one device at a time,
and each query chunk's attention takes every block as soon as it is in place.

Under context parallelism with ``Plan.ring`` each query chunk's attention reads the keys
and values whole, gathered from the group's chunks (as ``allgather`` does). Where every
forward reader of such a gather is an attention that reads it as its keys or values, the
gather is not one call but ``cp - 1`` steps round the ring (``AllGather.ring``): at step
``s`` each member's runs go to the member ``s`` after it, one collective of the group
each (all started at once, in one order on every member, as NCCL needs), and land in
the whole outputs member by member. The outputs are given to the readers as soon as the
steps start (``Wait.landing``); an attention waits for each block of keys and values
before its rows attend to it, its own first, then the members before it round the ring
(``graph.attention.sliced_attention``), so the rest of the bytes move while it computes.
A ``Wait`` after the last reader sees the whole gather in.

Guarantees: the same values as the gather; nothing else moves or changes order. The
backward reads the keys and values autograd kept (or gathered again, ``Plan.regather``),
block by block from the merged output and log-sum-exp, and sends each run's gradient to
its owner as before.
"""

from __future__ import annotations

from dataclasses import replace

from chronotope.compile.program import (
    AllGather,
    Backward,
    Forward,
    Free,
    Instruction,
    Refill,
    Reshard,
    Role,
    Wait,
    reads,
    writes,
)
from chronotope.compile.reshard import is_regather
from chronotope.graph.ir import fresh_name


def ring(ranks: list[list[Instruction]]) -> list[list[Instruction]]:
    """Every rank's code with each gather of keys and values that attention alone reads,
    on every member, landing run by run in its readers."""
    found = [_found(code) for code in ranks]
    # a gather rings where it does on every member (each calls it, the same call)
    keys = [{g.keys for g, _ in at.values()} for at in found]
    ringing = {g.keys for at in found for g, _ in at.values()
               if all(g.keys in keys[m] for m in g.ranks)}
    return [_rung(code, {i: (g, rs) for i, (g, rs) in at.items() if g.keys in ringing})
            for code, at in zip(ranks, found)]


def _found(code: list[Instruction]) -> dict[int, tuple[AllGather, list[int]]]:
    """Each gather of activations that attention pieces alone read, with where they do."""
    out = {}
    for i, ins in enumerate(code):
        if isinstance(ins, AllGather) and _gathers_activations(ins) and \
                (readers := _readers(code, i, ins)):
            out[i] = (ins, readers)
    return out


def _rung(code: list[Instruction], found: dict[int, tuple[AllGather, list[int]]]
          ) -> list[Instruction]:
    """``code`` with the gathers ``found`` ringing, read by the pieces there."""
    if not found:
        return code
    taken = {v for ins in code for v in (*reads(ins), *writes(ins))}
    before: dict[int, list[Instruction]] = {}
    after: dict[int, list[Instruction]] = {}
    out = list(code)
    for i, (gather, at) in found.items():
        handle = gather.handle or fresh_name(f"{gather.vars[0]}_ring", taken)
        taken.add(handle)
        out[i] = replace(gather, handle=handle, ring=True)
        if gather.handle is None:
            after.setdefault(i, []).append(Wait(handle, gather.vars, unpack=True, landing=True))
        else:
            w, wait = next((k, x) for k, x in enumerate(code)
                           if k > i and isinstance(x, Wait) and x.handle == handle)
            assert isinstance(wait, Wait)
            out[w] = replace(wait, landing=True)
        for k in at:
            f = out[k]
            assert isinstance(f, Forward)
            out[k] = replace(f, arriving=(*f.arriving, handle))
        # the whole gather in before what runs after its last reader (its storage freed)
        before.setdefault(at[-1] + 1, []).insert(0, Wait(handle, ()))
    made: list[Instruction] = []
    for k, ins in enumerate(out):
        made += before.get(k, [])
        made.append(ins)
        made += after.get(k, [])
    return made + before.get(len(out), [])


def _gathers_activations(ins: AllGather) -> bool:
    return len(ins.ranks) > 1 and not is_regather(ins) and bool(ins.keys) and \
        all(k.role is Role.VALUE for k in ins.keys)


def _readers(code: list[Instruction], at: int, gather: AllGather) -> list[int]:
    """Where attention pieces read what the gather at ``at`` gives, as their keys or values;
    none if anything else reads it before the backward (a view, another op)."""
    gathered = set(gather.vars)
    found = []
    for k in range(at + 1, len(code)):
        ins = code[k]
        if isinstance(ins, (Backward, Reshard, Refill, Free)) or (
                isinstance(ins, Wait) and ins.handle == gather.handle):
            continue  # (the backward reads what autograd kept)
        read = gathered & set(reads(ins))
        if not read:
            continue
        if not (isinstance(ins, Forward) and ins.op.op.kind == "attention" and
                all(ins.ins.index(v) in (1, 2) and ins.ins.count(v) == 1 for v in read)):
            return []
        found.append(k)
    return found
