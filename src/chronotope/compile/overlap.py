"""Communication that runs while the rank computes, in an order NCCL can match.

A receive or collective is started where it stands and waited on where its result
is first read (``Wait``), so the compute between the two runs while the bytes move.
A collective of values no parameter touches (a loss's count of tokens) starts with
the step, together with the local work that makes it. A collective of stored
parameters alone (ZeRO-3 gathering what it does not store) is prefetched as FSDP
does, one unit at a time (the parameters of one layer of a stack, as FSDP is wrapped
around each block): a unit's gathers start together, in one call, when the previous
unit's first reader starts, so they run while the pieces before their own readers
compute, and one unit is ahead at a time.
A receive is also posted ahead of the compute that precedes its first reader, within
one rule: NCCL matches a pair of ranks' messages by order, not by tag, and runs each
pair's sends and receives in the order they were posted, so both ranks must post the
messages between them in one order. That order is the one a replay of the code sends
them in: whoever sends a message posts it when the replay does, and the receiver
posts its receive after the pair's earlier messages and before its later ones (a
receive can always be posted early; a send is where its data is made). The replay
prices compute by its FLOPs, so the order is roughly the one the messages will be
sent in, and a receive is posted before the compute it can hide behind: the whole
micro-batch step or layer that compute belongs to, so that a step's or a layer's code is
the same whether or not a message is posted while it runs (one function, called between
posts).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace

from chronotope.compile.collectives import coalesce
from chronotope.compile.program import (
    COLLECTIVES,
    MULTI,
    STARTED,
    AllGather,
    Assemble,
    Backward,
    Broadcast,
    Exchange,
    Forward,
    Instruction,
    Load,
    Micro,
    Recv,
    Send,
    Wait,
    WeightGrad,
    first_reads,
    loads_param,
    reads,
    results,
    writes,
)
from chronotope.compile.replay import Costs, replay
from chronotope.compile.reshard import check_shared, is_regather, unit_of
from chronotope.cost.compute import piece_flops
from chronotope.errors import PlanError
from chronotope.graph.ir import fresh_name
from chronotope.plan.plan import PlanOp
from chronotope.plan.storage import unit

_COMPUTE = (Forward, Backward, WeightGrad)


class _Flops(Costs):
    """Compute priced by its FLOPs (and 1 per piece, so that none is free); messages free."""

    priced = frozenset(_COMPUTE)

    def __init__(self) -> None:
        self.known: dict[PlanOp, float] = {}  # a template's pieces run once per micro-batch

    def flops(self, op: PlanOp) -> float:
        if op not in self.known:
            self.known[op] = piece_flops(op) + 1.0
        return self.known[op]

    def local(self, rank: int, ins: Instruction, since: float) -> float:
        if isinstance(ins, Backward):
            ops = [*(f.op for f in ins.recompute if isinstance(f, Forward)), *ins.ops]
            return sum(self.flops(op) for op in ops)
        if isinstance(ins, (Forward, WeightGrad)):
            return self.flops(ins.op)
        return 0.0


def overlap(ranks: list[list[Instruction]]) -> list[list[Instruction]]:
    """Every rank's code with its receives posted in the pairs' common order, ahead of
    the compute before their use, and every communication waited on where first read."""
    tried: list[list[Instruction]] | None = None
    for moved in _candidates(ranks):
        if tried is not None and all(a is b for a, b in zip(moved, tried)):
            continue  # nothing moved: refused already
        played, tried = replay(moved, _Flops()), moved
        if played.runs_through:  # the members of each group still call alike
            ranks = moved
            break
    if played.stuck:
        raise PlanError(f"the compiled program would wait forever in "
                        f"{sorted(map(str, played.stuck.values()))}; this is a bug in "
                        f"chronotope, please report it with the plan")
    order = {key: i for i, key in enumerate(played.sends)}  # (src, dst, tag) -> when sent
    # Gathers that now start together (one piece's parameters) go in one flat call.
    ranks = coalesce(ranks, (AllGather,))
    for code in ranks:
        check_shared(code)
    # What nothing reads (a broadcast's root) is waited on where its micro-batch step
    # ends, so that no step hands a handle on to the next (each step is one function, see
    # codegen), where the code then runs through; else, as outside steps, where it ends.
    first = [_first_reads(code) for code in ranks]
    unread = [_unread_in_steps(code, first[rank]) for rank, code in enumerate(ranks)]
    if any(unread):
        started = [_started(rank, code, order, first[rank], unread[rank])
                   for rank, code in enumerate(ranks)]
        if replay(started).runs_through:
            return started
    return [_started(rank, code, order, first[rank], {}) for rank, code in enumerate(ranks)]


def _candidates(ranks: list[list[Instruction]]) -> Iterator[list[list[Instruction]]]:
    """The codes to try, most moved first: prefetched and hoisted, hoisted, as it is."""
    hoisted = [_hoisted(code) for code in ranks]
    yield [_prefetched(code) for code in hoisted]
    yield hoisted
    yield ranks


def _unread_in_steps(code: list[Instruction], first_read: dict[int, int]) -> dict[int, int]:
    """Each communication started in a micro-batch step whose result nothing reads (by
    index), and where its step ends."""
    ends = [i for i, ins in enumerate(code) if isinstance(ins, Micro)] + [len(code)]
    unread: dict[int, int] = {}
    inside = False
    for i, ins in enumerate(code):
        if isinstance(ins, Micro):
            inside = ins.index is not None
        elif inside and isinstance(ins, STARTED) and not isinstance(ins, Recv) \
                and i not in first_read:
            unread[i] = ends[bisect_left(ends, i)]
    return unread


def _started(rank: int, code: list[Instruction], order: dict[tuple, int],
             first: dict[int, int], unread: dict[int, int]) -> list[Instruction]:
    """``first``: where each communication is first read (``_first_reads``); ``unread``:
    those nothing reads, waited on at the index given (else at the end)."""
    first_read = first | unread
    # Slots: instruction i sits at 2i + 1; a posted receive goes into slot 2i (before i).
    posted = _posting_slots(rank, code, order, first_read)
    handles: set[str] = set()
    kept: list[tuple[int, Instruction]] = []  # (i, instruction i), at slot 2i + 1
    moved: list[tuple[tuple, Instruction]] = []  # posted receives and waits: even slots
    for i, ins in enumerate(code):
        if not isinstance(ins, STARTED):
            kept.append((i, ins))
            continue
        use = first_read.get(i, len(code))
        if isinstance(ins, Recv):
            slot = posted[i]
            if slot < 2 * use:
                handle = fresh_name(f"{ins.var}_pending", handles)
                ins = replace(ins, handle=handle)
                moved.append(((2 * use, 1), Wait(handle, (ins.var,))))
            moved.append(((slot, 0, order[(ins.src, rank, ins.tag)]), ins))
            continue
        if use > i + 1:
            made = results(ins)  # none on a broadcast's root: waited on as its step ends
            base = made[0] if made else f"{ins.src}_sent" if isinstance(ins, Broadcast) else ""
            handle = fresh_name(f"{base}_pending", handles)
            ins = replace(ins, handle=handle)
            moved.append(((2 * use, -1 if i in unread else 1),  # (before the next step's posts)
                          Wait(handle, made, unpack=isinstance(ins, (*MULTI, Exchange)))))
        kept.append((i, ins))
    moved.sort(key=lambda x: x[0])
    out: list[Instruction] = []

    def put(ins: Instruction) -> None:  # started and waited on back to back: a blocking call
        last = out[-1] if out else None
        if isinstance(ins, Wait) and isinstance(last, STARTED) and last.handle == ins.handle:
            out[-1] = replace(last, handle=None)
        else:
            out.append(ins)

    k = 0
    for i, ins in kept:  # merged by slot
        while k < len(moved) and moved[k][0][0] < 2 * i + 1:
            put(moved[k][1])
            k += 1
        put(ins)
    for _, ins in moved[k:]:
        put(ins)
    return out


def _hoisted(code: list[Instruction]) -> list[Instruction]:
    """``code`` with each collective whose inputs only batch data and constants make moved
    to the start, with what makes them (in their order)."""
    made = {var: i for i, ins in enumerate(code) for var in writes(ins)}
    moved: set[int] = set()
    for i, ins in enumerate(code):
        if not isinstance(ins, COLLECTIVES):
            continue
        chain: set[int] = set()
        todo = [made[v] for v in reads(ins) if v in made]
        while todo:  # what makes its inputs, back to the leaves, while none is touched
            j = todo.pop()
            if not _untouched(code[j]):
                break
            if j not in chain:
                chain.add(j)
                todo += [made[v] for v in reads(code[j]) if v in made]
        else:
            if chain:
                moved |= {*chain, i}
    if not moved:
        return code
    return [code[i] for i in sorted(moved)] + [x for i, x in enumerate(code) if i not in moved]


def _prefetched(code: list[Instruction]) -> list[Instruction]:
    """``code`` with each collective of stored parameters alone (and the loads it reads)
    moved to just before the first reader of the previous such collective."""
    params = {ins.var for ins in code if isinstance(ins, Load) and ins.source == "param"}
    if not any(isinstance(ins, COLLECTIVES) and (vs := reads(ins)) and params.issuperset(vs)
               for ins in code):
        return code  # (most plans: none, and no need to scan further)
    made = {var: i for i, ins in enumerate(code) for var in writes(ins)}
    first = _first_reads(code)
    place: dict[int, int] = {}  # moved instruction -> the instruction it now precedes
    unit = reader = ahead = None  # the latest gathers' unit and first reader, and the one's before
    for i, ins in enumerate(code):
        if not isinstance(ins, COLLECTIVES) or i not in first or is_regather(ins):
            continue  # a unit gathered again for its backward is already one ahead
        loads = [made[v] for v in reads(ins) if v in made]
        if not loads or len(loads) < len(reads(ins)) or not all(
                loads_param(code[j]) for j in loads):
            continue
        if (found := unit_of(code[first[i]], first[i])) != unit:  # one unit's start together
            unit, reader, ahead = found, first[i], reader
        if ahead is not None and ahead < i:
            place.update(dict.fromkeys([*loads, i], ahead))
    if not place:
        return code
    # the loads first, then the gathers back to back: one flat call (``coalesce``)
    order = sorted(range(len(code)), key=lambda i: (place[i], 0, not isinstance(code[i], Load),
                                                    i) if i in place else (i, 1, 0, i))
    return [code[i] for i in order]


def _untouched(ins: Instruction) -> bool:
    """Local work on values no parameter and no gradient reach."""
    if isinstance(ins, Load):
        return ins.source in ("input", "constant")
    if isinstance(ins, Forward):
        return not (any(ins.grad) or any(ins.out_grad) or ins.recompute)
    return isinstance(ins, Assemble)


def _first_reads(code: list[Instruction]) -> dict[int, int]:
    """For each receive or collective (by index), the index of the first instruction that
    reads what it gives."""
    first = first_reads(code)
    return {i: min(first[v] for v in results(ins) if v in first) for i, ins in enumerate(code)
            if isinstance(ins, STARTED) and any(v in first for v in results(ins))}


def _post_before(code: list[Instruction]) -> list[int]:
    """For each compute, in order, where a receive posted ahead of it goes: before the
    micro-batch step it belongs to (a template's block), else before the first compute
    of its unit's run (a layer's forward or backward, ``plan.storage.unit``), else before
    the compute itself. A step's or a layer's code is then the same whether or not a
    message is posted while it runs: codegen writes the post between their calls."""
    starts: list[int] = []
    last: tuple | None = None
    block: int | None = None  # where the current micro-batch's step starts
    for i, ins in enumerate(code):
        if isinstance(ins, Micro):
            block = i if ins.index is not None else None
            last = None  # another micro-batch's
        elif isinstance(ins, _COMPUTE):
            found = _unit(ins)
            starts.append(block if block is not None else
                          starts[-1] if found is not None and found == last else i)
            last = found
    return starts


def _unit(ins: Instruction) -> tuple | None:
    """A compute's unit and direction; None for one of no unit."""
    ops = ins.ops if isinstance(ins, Backward) else (
        (ins.op,) if isinstance(ins, (Forward, WeightGrad)) else ())
    found = {unit(op.op) for op in ops}
    if len(found) != 1 or None in found:
        return None
    return (found.pop(), isinstance(ins, Forward))


def _posting_slots(rank: int, code: list[Instruction], order: dict[tuple, int],
                   first_read: dict[int, int]) -> dict[int, int]:
    """Where each receive (by index) is posted: ahead of the compute before its first
    reader, as far as the order of its pair's messages allows."""
    compute = [i for i, ins in enumerate(code) if isinstance(ins, _COMPUTE)]
    ahead = _post_before(code)
    pairs: dict[int, list[tuple[int, int, bool]]] = defaultdict(list)  # peer -> (when, i, recv)
    for i, ins in enumerate(code):
        if isinstance(ins, Send):
            pairs[ins.dst].append((order[(rank, ins.dst, ins.tag)], i, False))
        elif isinstance(ins, Recv):
            pairs[ins.src].append((order[(ins.src, rank, ins.tag)], i, True))
    slots: dict[int, int] = {}
    for messages in pairs.values():
        messages.sort()
        upper = []  # latest slot each may take, so the pair's later messages stay after it
        bound = 2 * len(code)
        for _, i, is_recv in reversed(messages):
            bound = min(bound, 2 * first_read.get(i, len(code))) if is_recv else 2 * i
            upper.append(bound)
        upper.reverse()
        lower = 0
        for (_, i, is_recv), most in zip(messages, upper):
            if not is_recv:
                lower = 2 * i + 2
                continue
            use = first_read.get(i, len(code))
            before = bisect_left(compute, use)  # computes ahead of the first reader
            wanted = 2 * ahead[before - 1] if before else 2 * use
            slot = max(lower, min(wanted, most))
            if slot > most:
                raise PlanError(f"rank {rank} cannot post message {code[i]} in the order its "
                                "pair sends: this is a bug in chronotope, please report it "
                                "with the plan")
            slots[i] = lower = slot
    return slots
