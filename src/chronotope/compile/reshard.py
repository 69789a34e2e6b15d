"""Gathered tensors freed after their forward and gathered again for their backward.

ZeRO-3 gathers the parameter regions a rank does not store, one unit at a time (a
layer of a stack, see ``plan.storage.unit``). Autograd keeps what the unit's pieces save for
backward, the gathered weights among it, so without more the whole model is
gathered by the end of the forward. As FSDP2 reshards after forward, a unit's
storage is freed (``Reshard``) once its last forward reader is done, and before its
backward the unit is gathered again, in one call on fresh loads of the stored
shards, and ``Refill`` copies what it gives back into the freed storage: autograd's
saved tensors, the gathered weights or views of them, hold them again. The gather
again starts one unit ahead, where the unit needed before it starts its backward;
the autograd regions (``autograd_regions``) end where a unit's gather lands, so one unit's
backward runs at a time.

A unit is resharded only where that is safe and gains something: every piece that
reads it makes a new tensor (a projection, a norm, arithmetic; never a view of its
input, which would keep pointing into the freed storage), all its forward reads come
before its backward, and another unit's pieces run in between (the unit whose forward
ends the model goes straight on to its backward, as FSDP2 leaves the root).

Activations gathered for pieces that save them (the keys and values context parallelism
gathers for each query chunk's attention, an input sequence parallelism gathers for a
projection) are freed and gathered again alike (``Plan.regather``), as Megatron does for
sequence parallelism: each rank keeps its own runs alive until the gather runs again,
and holds one unit's gathered copy at a time instead of every layer's.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace

from chronotope.compile.program import (
    AllGather,
    Assemble,
    Backward,
    Forward,
    Instruction,
    Load,
    Refill,
    Reshard,
    Role,
    WeightGrad,
    first_reads,
    flat,
    loads_param,
    reads,
    writes,
)
from chronotope.errors import PlanError
from chronotope.graph.ir import fresh_name
from chronotope.plan.plan import PlanOp
from chronotope.plan.storage import ALLOCATING, unit

AGAIN = "again"  # the last part of each key of a gather run again for the backward


def unit_of(reader: Instruction, at: int) -> object:
    """The unit a gather belongs to, by its first reader (``plan.storage.unit``); a reader
    from no module is a unit of its own."""
    found = unit(reader.op.op) if isinstance(reader, Forward) else None
    return at if found is None else found


def is_regather(ins: Instruction) -> bool:
    return isinstance(ins, AllGather) and bool(ins.keys) and ins.keys[0].marks[-1:] == (AGAIN,)


@dataclass
class _Unit:
    gathers: list[AllGather]
    forward: list[int]  # where its pieces and the views cut out of it read it
    backward: list[int]  # the backward pieces that use what those pieces saved

    @property
    def vars(self) -> tuple[str, ...]:
        return tuple(v for g in self.gathers for v in g.vars)


def reshard(code: list[Instruction], params: bool = True, activations: bool = False
            ) -> list[Instruction]:
    """One rank's code (backward pieces not yet fused) with every gathered unit (of stored
    parameter regions, or with ``activations`` of what other ranks made) that may be freed
    between its forward and its backward freed there and gathered again before its
    backward, one unit ahead."""
    made = {var: i for i, ins in enumerate(code) for var in writes(ins)}
    units: dict[object, _Unit | None] = {}
    first = first_reads(code)
    for i, ins in enumerate(code):
        if not (params and _gathers_stored(ins, code, made)
                or activations and _gathers_made(ins, code, made)):
            continue
        assert isinstance(ins, AllGather)
        reader = min((first[v] for v in ins.vars if v in first), default=None)
        key = i if reader is None else unit_of(code[reader], reader)
        use = _uses(code, i, ins)
        mine = units.setdefault(key, _Unit([], [], []))
        if use is None or mine is None:
            units[key] = None  # read by what may keep a view of it: never freed
            continue
        mine.gathers.append(ins)
        mine.forward = sorted(mine.forward + use[0])
        mine.backward = sorted(mine.backward + use[1])
    ready = [u for u in units.values() if u is not None and u.forward and u.backward
             and u.forward[-1] < u.backward[0]]
    freed = sorted((u for u in ready if any(u.forward[-1] < i < u.backward[0]
                                           for w in ready if w is not u for i in w.forward)),
                   key=lambda u: u.backward[0])
    if not freed:
        return code
    taken = {v for ins in code for v in (*reads(ins), *writes(ins))}
    before: dict[int, list[Instruction]] = defaultdict(list)  # index -> what goes before it
    after: dict[int, list[Instruction]] = defaultdict(list)  # index -> what goes after it
    for k, u in enumerate(freed):
        after[u.forward[-1]].append(Reshard(u.vars))
        # one unit ahead; the first when the backward starts
        start = freed[k - 1].backward[0] if k else next(
            i for i in range(u.forward[-1], u.backward[0] + 1)
            if isinstance(code[i], (Backward, WeightGrad)))
        for loads, again in _again(code, u, made, taken):
            before[start] += [*loads, again]
            nbytes = sum(math.prod(s) for s in again.shapes) * again.dtype.itemsize
            before[u.backward[0]].append(Refill(_outputs_of(u, again), again.vars, nbytes))
    out: list[Instruction] = []
    for i, ins in enumerate(code):
        out += before.get(i, [])
        out.append(ins)
        out += after.get(i, [])
    return out


def check_shared(code: list[Instruction]) -> None:
    """Refuse code where one gather's flat buffer holds tensors of two units (merged after
    the reshards were placed): freeing one unit's storage would free the other's too."""
    freed = {v: ins for ins in code if isinstance(ins, Reshard) for v in ins.vars}
    for ins in code:
        if isinstance(ins, AllGather) and any(v in freed for v in ins.vars):
            if any(freed.get(v) is not freed.get(ins.vars[0]) for v in ins.vars):
                raise PlanError(f"gathered parameters {', '.join(ins.vars)} share one buffer "
                                "but are freed apart; this is a bug in chronotope, please "
                                "report it with the plan")


def _gathers_stored(ins: Instruction, code: list[Instruction], made: dict[str, int]) -> bool:
    """Whether ``ins`` gathers stored parameter regions over several ranks."""
    return isinstance(ins, AllGather) and len(ins.ranks) > 1 and not is_regather(ins) and all(
        v in made and loads_param(code[made[v]]) for v in ins.srcs)


def _gathers_made(ins: Instruction, code: list[Instruction], made: dict[str, int]) -> bool:
    """Whether ``ins`` gathers activations over several ranks: its pieces are made here (by
    pieces, or side by side from them), not loaded."""
    return isinstance(ins, AllGather) and len(ins.ranks) > 1 and not is_regather(ins) and \
        all(k.role is Role.VALUE for k in ins.keys) and all(
            v in made and isinstance(code[made[v]], (Forward, Assemble)) for v in ins.srcs)


def _uses(code: list[Instruction], at: int, gather: AllGather
          ) -> tuple[list[int], list[int]] | None:
    """Where what the gather at ``at`` gives is read in the forward, and where a backward
    uses what its readers saved; None if a reader may keep a view of it (or send it)."""
    aliases = set(gather.vars)  # the gathered tensors and views cut out of them
    readers: set[PlanOp] = set()
    forward: list[int] = []
    backward: list[int] = []
    for i in range(at + 1, len(code)):
        x = code[i]
        if isinstance(x, (Backward, WeightGrad)):
            pieces = x.ops if isinstance(x, Backward) else (x.op,)
            if any(p.forward in readers for p in pieces) or (
                    isinstance(x, Backward) and aliases & set(x.remade_inputs())):
                backward.append(i)
            continue
        if not aliases & set(reads(x)):
            continue
        if isinstance(x, Forward) and x.op.op.kind in ALLOCATING:
            readers.add(x.op)
        elif isinstance(x, Assemble) and x.is_view:
            aliases.add(x.var)
        elif not isinstance(x, Assemble):
            return None
        forward.append(i)
    return forward, backward


def _again(code: list[Instruction], unit: _Unit, made: dict[str, int], taken: set[str],
           ) -> list[tuple[list[Load], AllGather]]:
    """The unit's gathers run again: fresh loads of the stored shards, then one flat call
    per group of ranks and dtype."""
    calls: dict[tuple, list[tuple[AllGather, int]]] = defaultdict(list)
    for g in unit.gathers:
        calls[(g.ranks, g.dtype, g.slots)] += [(g, k) for k in range(len(g.vars))]
    def again(v: str) -> str:
        return fresh_name(f"{v}_{AGAIN}", taken)

    out = []
    for outputs in calls.values():
        call = flat(outputs)
        # a stored parameter region is loaded afresh; an activation's own runs are read as
        # they are, kept alive until here
        loads = [replace(load, var=again(v)) for v in call.srcs
                 if isinstance(load := code[made[v]], Load)]
        srcs = tuple(x.var for x in loads) if loads else call.srcs
        out.append((loads, replace(call, vars=tuple(map(again, call.vars)), srcs=srcs,
                                   keys=tuple(key.marked(AGAIN) for key in call.keys))))
    return out


def _outputs_of(unit: _Unit, again: AllGather) -> tuple[str, ...]:
    """The unit's gathered tensors that ``again`` gives anew, in its order."""
    by_key = {key: var for g in unit.gathers for key, var in zip(g.keys, g.vars)}
    return tuple(by_key[replace(key, marks=key.marks[:-1])] for key in again.keys)

