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

The backward is a ring too (``Leave``). It reads the keys and values autograd kept (or
gathered again, ``Plan.regather``) block by block, from the merged output and
log-sum-exp, its own first and then round the ring; the gradients of each member's runs
go to that member as soon as every piece here gave its part, a step of the ring each (one
collective of the group, started in step order on every member), while the blocks after
them compute. They replace the messages that sent each run's gradient to its owner after
the backward. A backward rings where, on every member, its pieces' gradients of the keys
and values go nowhere but to the owners and their own runs, and nothing else
communicates from the first of its backward calls to the last (so the steps keep their
place among the group's calls); elsewhere the messages stay.

Guarantees: the same values as the gather and as the messages; nothing else moves or
changes order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

from chronotope.compile.program import (
    COLLECTIVES,
    AllGather,
    Assemble,
    Backward,
    Forward,
    Free,
    GatherParams,
    Instruction,
    Leave,
    Part,
    PullParam,
    PushParam,
    Recv,
    ReduceScatter,
    Refill,
    Reshard,
    Role,
    Send,
    Slices,
    Wait,
    covers,
    reads,
    writes,
)
from chronotope.compile.reshard import is_regather
from chronotope.graph.ir import fresh_name


def ring(ranks: list[list[Instruction]], backward: bool = True) -> list[list[Instruction]]:
    """Every rank's code with each gather of keys and values that attention alone reads,
    on every member, landing run by run in its readers; with ``backward``, their gradients
    leaving run by run where they can."""
    found = [_found(code) for code in ranks]
    # a gather rings where it does on every member (each calls it, the same call)
    keys = [{g.keys for g, _ in at.values()} for at in found]
    ringing = {g.keys for at in found for g, _ in at.values()
               if all(g.keys in keys[m] for m in g.ranks)}
    rung = [_rung(code, {i: (g, rs) for i, (g, rs) in at.items() if g.keys in ringing})
            for code, at in zip(ranks, found)]
    return _leaving(rung) if backward and ringing else rung


_COMMUNICATES = (Send, Recv, Wait, PushParam, PullParam, GatherParams, *COLLECTIVES)


@dataclass
class _Leaves:
    """What one rank's backward of one ring attention (its keys' and values' gathers) does
    with their gradients, where it can leave run by run."""

    gathers: tuple[tuple[str, int] | None, ...]  # the readers' ``arriving``
    sources: dict[int, tuple[AllGather, int]]  # by role (keys 0, values 1): gather, output
    calls: list[int]  # its backward calls
    grads: dict[str, int]  # the pieces' gradients of the keys (role 0) and values (1)
    sends: dict[int, tuple[int, int, Slices]] = field(default_factory=dict)  # at: dst, role, box
    dropped: set[int] = field(default_factory=set)  # the sums the sends read
    takes: list[tuple[str, int, int, Slices]] = field(default_factory=list)  # var, src, role..
    gone: set[int] = field(default_factory=set)  # receives (and their waits) it replaces
    # reduce-scatters of them it replaces: at, per output: its name, role and local parts
    scatters: dict[int, list[tuple[str, int, tuple[str, ...]]]] = field(default_factory=dict)

    @property
    def first(self) -> AllGather:
        return next(iter(self.sources.values()))[0]

    @property
    def key(self) -> tuple:
        """What names it on every member: its gathers' outputs."""
        return tuple((g.keys, out) for g, out in self.sources.values())


def _leaving(ranks: list[list[Instruction]]) -> list[list[Instruction]]:
    """Every rank's code with each ring attention's backward leaving run by run (``Leave``)
    where it can on every member, its messages to the owners gone."""
    found = [_leaves(r, code) for r, code in enumerate(ranks)]
    at = {(r, lv.key): lv for r, lvs in enumerate(found) for lv in lvs}
    ok = {key for (r, key), lv in at.items()
          if all((m, key) in at for m in lv.first.ranks)}
    for (r, key), lv in at.items():  # each message's receive, on its owner
        if key not in ok:
            continue
        for k, (dst, role, box) in lv.sends.items():
            send = ranks[r][k]
            assert isinstance(send, Send)
            owner = at[(dst, key)]
            posted = [(i, x) for i, x in enumerate(ranks[dst]) if isinstance(x, Recv)
                      and x.src == r and x.tag == send.tag]
            if not posted:
                ok.discard(key)
                break
            i, recv = posted[0]
            owner.gone.add(i)
            if recv.handle is not None:
                owner.gone |= {j for j, x in enumerate(ranks[dst]) if isinstance(x, Wait)
                               and x.handle == recv.handle}
            owner.takes.append((recv.var, r, role, box))
    for (r, key), lv in at.items():  # nothing else communicates among its calls, and what
        gone = {*lv.sends, *lv.gone, *lv.scatters}  # came is read after them
        code = ranks[r]
        came = {var for var, *_ in lv.takes} | {
            var for outs in lv.scatters.values() for var, _, _ in outs}
        if any(isinstance(code[k], _COMMUNICATES) and k not in gone
               for k in range(lv.calls[0], lv.calls[-1] + 1)) or \
                any(came & set(reads(code[k])) for k in range(lv.calls[-1] + 1)):
            ok.discard(key)
    return [_left(r, code, [lv for lv in lvs if lv.key in ok])
            for r, (code, lvs) in enumerate(zip(ranks, found))]


def _leaves(rank: int, code: list[Instruction]) -> list[_Leaves]:
    """Each ring attention's backward on this rank whose gradients of the keys and values
    go nowhere but to their owners (messages) and to this rank's own runs."""
    handles = {ins.handle: ins for ins in code if isinstance(ins, AllGather) and ins.ring}
    readers: dict[tuple, list[Forward]] = {}
    for ins in code:
        if isinstance(ins, Forward) and ins.arriving:
            readers.setdefault(ins.arriving, []).append(ins)
    out = []
    for arriving, pieces in readers.items():
        sources = {role: (handles[s[0]], s[1]) for role, s in enumerate(arriving)
                   if s is not None}
        found = None if any(f.recompute for f in pieces) else _grads(code, pieces, arriving)
        if found is None:
            continue
        calls, grads = found
        lv = _Leaves(arriving, sources, calls, grads)
        if _uses(rank, code, calls[0], grads, sources, lv):
            out.append(lv)
    return out


def _grads(code: list[Instruction], pieces: list[Forward], arriving: tuple
           ) -> tuple[list[int], dict[str, int]] | None:
    """The backward calls of ``pieces`` and their gradients of the ringed keys (role 0) and
    values (role 1), by name; None if a piece's backward is not found."""
    calls, grads = set(), {}
    for f in pieces:
        at = next(((k, j) for k, ins in enumerate(code) if isinstance(ins, Backward)
                   for j, op in enumerate(ins.ops) if op.forward == f.op), None)
        if at is None:
            return None
        k, j = at
        call = code[k]
        assert isinstance(call, Backward)
        given = f.input_grads()
        for role, source in enumerate(arriving):
            if source is not None and role + 1 in given:
                g = call.outs[j][given.index(role + 1)]
                if g is not None:
                    grads[g] = role
        calls.add(k)
    return sorted(calls), grads


def _uses(rank: int, code: list[Instruction], start: int, grads: dict[str, int],
          sources: dict[int, tuple[AllGather, int]], lv: _Leaves) -> bool:
    """Whether every read of ``grads`` after ``start`` is a message to the owner of its run
    (or a sum of them that such messages read), or a part of this rank's own runs; the
    messages and sums go in ``lv``."""
    sums: dict[str, int] = {}
    for k in range(start, len(code)):
        ins = code[k]
        read = [v for v in reads(ins) if v in grads or v in sums]
        if not read:
            continue
        role = grads.get(read[0], sums.get(read[0]))
        assert role is not None
        gather, out = sources[role]
        whole = gather.shapes[out]
        if isinstance(ins, Send):
            box = ins.slices or tuple(slice(0, n) for n in whole)
            if _owner(gather, out, box) != ins.dst or ins.dst == rank:
                return False
            lv.sends[k] = (ins.dst, role, box)
        elif isinstance(ins, Assemble) and ins.shape == whole and all(
                grads.get(p.src) == role and p.scale == 1 and p.src_slices == p.dst_slices
                and covers(p.dst_slices, whole) for p in ins.parts):
            sums[ins.var] = role  # the pieces' sum the messages send
            lv.dropped.add(k)
        elif isinstance(ins, Assemble):
            if any(p.src in sums or (p.src in grads and
                                     _owner(gather, out, p.src_slices) != rank)
                   for p in ins.parts):
                return False
        elif isinstance(ins, ReduceScatter):
            if not _scatters(ins, grads, sources):
                return False
            lv.scatters[k] = [(var, grads[srcs[0]], srcs)
                              for var, srcs in zip(ins.vars, ins.srcs)]
            lv.gone |= {j for j, x in enumerate(code) if isinstance(x, Wait)
                        and ins.handle is not None and x.handle == ins.handle}
        else:
            return False
    return True


def _scatters(ins: ReduceScatter, grads: dict[str, int],
              sources: dict[int, tuple[AllGather, int]]) -> bool:
    """Whether ``ins`` sums the pieces' gradients of whole gathered keys or values (and
    nothing else), each member getting its own run, as the gathers place them."""
    for srcs, dim in zip(ins.srcs, ins.dims):
        roles = {grads.get(v) for v in srcs}
        if len(roles) != 1 or None in roles:
            return False
        gather, out = sources[roles.pop()]  # type: ignore[index]
        if gather.slots or tuple(gather.ranks) != tuple(ins.ranks) or gather.dims[out] != dim:
            return False
    return True



def _owner(gather: AllGather, out: int, box: Slices) -> int | None:
    """The member whose run along the dim of the gather's output ``out`` ``box`` lies in
    (None: it spans two)."""
    slots = gather.slots or gather.ranks
    dim = gather.dims[out]
    size = gather.shapes[out][dim] // len(slots)
    lo, hi = box[dim].start, box[dim].stop
    return slots[lo // size] if (hi - 1) // size == lo // size else None


def _left(rank: int, code: list[Instruction], leaves: list[_Leaves]) -> list[Instruction]:
    """``code`` with each backward of ``leaves`` leaving: its messages and the receives of
    theirs (or its reduce-scatters) gone, a ``Leave`` before its first call and its
    ``Wait`` after the last, which gives what the receives gave (one name per box from one
    member; a second name of the same box is no longer a part of any sum), and each
    reduce-scatter's own run summed from its local parts and what came."""
    if not leaves:
        return code
    taken = {v for ins in code for v in (*reads(ins), *writes(ins))}
    before: dict[int, Instruction] = {}
    after: dict[int, list[Instruction]] = {}
    gone: set[int] = set()
    again: set[str] = set()  # second names of a box
    rewritten: dict[int, Instruction] = {}  # sums of this rank's runs, reading what was kept
    for lv in leaves:
        gone |= {*lv.sends, *lv.dropped, *lv.gone, *lv.scatters}
        first = lv.first
        handle = fresh_name(f"{first.vars[0]}_leaving", taken)
        taken.add(handle)
        seen: dict[tuple, str] = {}
        takes = []
        for var, src, role, box in lv.takes:
            at = (src, role, tuple((s.start, s.stop) for s in box))
            if at in seen:
                again.add(var)
            else:
                seen[at] = var
                takes.append((var, src, role, box))
        kept = _kept(code, lv, taken)
        if kept is not None:
            rewritten.update(kept[0])
            takes += [(var, rank, role, box) for var, role, box in kept[1]]
        sums = []
        for k, outs in lv.scatters.items():
            scatter = code[k]
            assert isinstance(scatter, ReduceScatter)
            for var, role, srcs in outs:
                gather, out = lv.sources[role]
                box = _run(gather, out, rank)
                mine = tuple(slice(0, s.stop - s.start) for s in box)
                if kept is None:
                    parts = [Part(d, box, mine, Fraction(1)) for d in srcs]
                else:  # what the leaving kept of this rank's run
                    name = fresh_name(f"{var}_here", taken)
                    taken.add(name)
                    takes.append((name, rank, role, box))
                    parts = [Part(name, mine, mine, Fraction(1))]
                for m in gather.ranks:
                    if m != rank:
                        came = fresh_name(f"{var}_from{m}", taken)
                        taken.add(came)
                        takes.append((came, m, role, box))
                        parts.append(Part(came, mine, mine, Fraction(1)))
                sums.append(Assemble(var, tuple(s.stop for s in mine), scatter.dtype, parts))
        shapes = tuple(g.shapes[out] for g, out in lv.sources.values())
        before[lv.calls[0]] = Leave(
            handle, lv.gathers, tuple(t[0] for t in takes), tuple(t[1] for t in takes),
            tuple(t[2] for t in takes), tuple(t[3] for t in takes), first.ranks, shapes,
            first.dtype, replace(first.keys[0], role=Role.GRADIENT))
        after[lv.calls[-1]] = [Wait(handle, tuple(t[0] for t in takes), unpack=True), *sums]
    made: list[Instruction] = []
    for k, ins in enumerate(code):
        if k in before:
            made.append(before[k])
        if k in gone:
            continue
        ins = rewritten.get(k, ins)
        if isinstance(ins, Assemble) and again & {p.src for p in ins.parts}:
            ins = replace(ins, parts=[p for p in ins.parts if p.src not in again])
        made.append(ins)
        made += after.get(k, [])
    return made


def _kept(code: list[Instruction], lv: _Leaves, taken: set[str]
          ) -> tuple[dict[int, Assemble], list[tuple[str, int, Slices]]] | None:
    """The sums of this rank's own runs from the pieces' gradients, each reading instead
    the sum the leaving kept of its box (one name per box: the pieces' parts added as they
    left), so that no piece makes a gradient of the whole keys and values; with the names
    (role, box). None where such a sum comes before the last call or a box is read twice."""
    summed: dict[int, Assemble] = {}
    here: list[tuple[str, int, Slices]] = []
    named: set[tuple] = set()
    for k in range(lv.calls[0], len(code)):  # (the calls make the gradients)
        ins = code[k]
        if k in lv.dropped or not isinstance(ins, Assemble) or \
                not any(p.src in lv.grads for p in ins.parts):
            continue
        if k < lv.calls[-1] or ins.accumulate:
            return None
        parts: list[Part] = []
        boxes: dict[tuple, Part] = {}
        for p in ins.parts:
            if p.src not in lv.grads:
                parts.append(p)
                continue
            at = (lv.grads[p.src], tuple((s.start, s.stop) for s in p.src_slices))
            if p.scale != 1 or at in named or boxes.get(at, p).dst_slices != p.dst_slices:
                return None
            if at not in boxes:
                var = fresh_name(f"{ins.var}_here", taken)
                taken.add(var)
                here.append((var, at[0], p.src_slices))
                boxes[at] = Part(var, tuple(slice(0, s.stop - s.start) for s in p.src_slices),
                                 p.dst_slices, Fraction(1))
                parts.append(boxes[at])
        named |= set(boxes)
        summed[k] = replace(ins, parts=parts)
    return summed, here


def _run(gather: AllGather, out: int, member: int) -> Slices:
    """The box of ``member``'s one run in the gather's whole output ``out``."""
    whole, dim = gather.shapes[out], gather.dims[out]
    size = whole[dim] // len(gather.ranks)
    i = gather.ranks.index(member)
    return tuple(slice(i * size, (i + 1) * size) if d == dim else slice(0, n)
                 for d, n in enumerate(whole))


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
            arriving = list(f.arriving or (None, None))
            for v in set(gather.vars) & set(f.ins):  # (inputs 1 and 2: keys, values)
                arriving[f.ins.index(v) - 1] = (handle, gather.vars.index(v))
            out[k] = replace(f, arriving=tuple(arriving))
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
