"""The collectives lowering recognised, written once every member is known to agree.

Lowering sees one reader at a time. Where a read is one rank's share of a collective
(``Pattern``: each member sums the same region from one piece on each of them, an
all-reduce; joins it from one piece per member, an all-gather; sums its own run of a
region all of them hold partials of, a reduce-scatter; reads its run along one dim
of pieces that are runs along another, an all-to-all), it writes that, with no
messages: an ``Assemble`` with the pattern and no parts. This pass, which sees every
rank, writes the collective where exactly the ranks holding the pieces read it alike
(in one step of a template). A collective blocks every member until all arrive,
where messages do not, so the code is then run symbolically. A pattern whose members
disagree, or that some rank would wait in forever (a member first waits on a message
sent after it), is ``Refused``: lowering writes those reads again as messages. The
routed messages of expert parallelism become their exchanges (``compile/exchanges.py``;
refused alike, their tokens then sent whole). Last, one piece sent to several ranks
becomes a broadcast, where the code still runs through, and back-to-back collectives
over one group are coalesced.
"""

from __future__ import annotations

from collections import defaultdict

from chronotope.compile.exchanges import exchanges
from chronotope.compile.program import (
    MULTI,
    AllGather,
    AllReduce,
    AllToAll,
    Assemble,
    Block,
    Broadcast,
    CollectiveKind,
    Instruction,
    Key,
    Load,
    Pattern,
    Recv,
    ReduceScatter,
    Role,
    Send,
    flat,
    reads,
)
from chronotope.compile.replay import replay


class Stuck(Exception):
    """The code waits forever in these collectives or receives (keys, ("recv", src, tag))."""

    def __init__(self, keys: set[tuple]) -> None:
        super().__init__(f"ranks wait forever in {sorted(map(str, keys))}")
        self.keys = keys


class Refused(Exception):
    """Collectives lowering recognised that cannot be written (the ``Pattern`` keys): their
    members disagree, or the code would wait in them forever. Lower them as messages."""

    def __init__(self, keys: set[Key]) -> None:
        super().__init__(f"collectives refused: {sorted(map(str, keys))}")
        self.keys = keys


def collectives(ranks: list[list[Instruction]]) -> list[list[Instruction]]:
    """Every pattern written as its collective, or ``Refused``."""
    found: dict[tuple[CollectiveKind, Key], list[tuple[int, Assemble, Pattern]]] = defaultdict(list)
    for rank, code in enumerate(ranks):
        for ins in code:
            if isinstance(ins, Assemble) and ins.pattern is not None:
                found[(ins.pattern.kind, ins.pattern.key)].append((rank, ins, ins.pattern))
    chosen: dict[int, tuple[int, ...]] = {}  # id(Assemble) -> members, in the pattern's order
    step = _steps(ranks)
    for (kind, key), members in found.items():
        order = _members(kind, key, members)
        if order is not None and len({step.get(id(ins)) for _, ins, _ in members}) == 1:
            for _, ins, _ in members:
                chosen[id(ins)] = order
    refused = {key for (_, key), members in found.items()
               if any(id(ins) not in chosen for _, ins, _ in members)}
    if refused:
        raise Refused(refused)
    out = [[_collective(ins, chosen[id(ins)]) if isinstance(ins, Assemble)
            and id(ins) in chosen else ins for ins in code] for code in ranks]
    out, unplaced = exchanges(_drop_unread(out))
    if unplaced:
        raise Refused(unplaced)
    stuck = _stuck(out)
    if stuck:
        # a collective blocks where messages would not
        waited = {key for _, key in found if key in stuck} | \
            {key for key in stuck if isinstance(key, Key) and key.via[:1] == ("experts",)}
        if waited:
            raise Refused(waited)
        raise Stuck(stuck)  # not a collective lowering recognised: the caller's to undo
    refused_casts: set[tuple] = set()
    for _ in range(_BROADCAST_TRIES):  # on top of code that runs through, as far as it still does
        cast = _broadcasts(out, refused_casts, _steps(out))
        stuck = _stuck(cast)
        if not stuck:
            out = cast
            break
        refused_casts |= stuck
    return coalesce(out)


_BROADCAST_TRIES = 3  # a broadcast only saves the root's sends: not worth many symbolic runs


def _steps(ranks: list[list[Instruction]]) -> dict[int, object]:
    """In a template's code, the step (``Block``) each instruction belongs to, by id: a
    collective's members must all be in one step, which runs once per micro-batch on
    each of them (messages between steps are matched per micro-batch instead)."""
    out: dict[int, object] = {}
    marked = False
    for code in ranks:
        cell: object = "before"
        for ins in code:
            if isinstance(ins, Block):
                cell, marked = ins.cell if ins.cell is not None else "after", True
            out[id(ins)] = cell
    return out if marked else {}


def _broadcasts(ranks: list[list[Instruction]], refused: set[tuple], step: dict[int, object],
                ) -> list[list[Instruction]]:
    """One region a rank sends to two or more others becomes one broadcast."""
    sends: dict[tuple, list[Send]] = defaultdict(list)
    recvs: dict[tuple[int, int], Recv] = {}
    for rank, code in enumerate(ranks):
        for ins in code:
            if isinstance(ins, Send) and ins.rows is None:  # (routed rows differ per reader)
                box = tuple((x.start, x.stop) for x in ins.slices)
                sends[(rank, ins.var, box)].append(ins)
            elif isinstance(ins, Recv):
                recvs[(ins.src, ins.tag)] = ins
    # per rank: what replaces a send or receive (whether the rank is the root, the members,
    # the key, the first send); None: nothing
    swap: list[dict[tuple, tuple[bool, tuple[int, ...], Key, Send] | None]] = [{} for _ in ranks]
    for (root, var, box), group in sends.items():
        key = Key(var, box, Role.VALUE, ("broadcast", root))
        dsts = [s.dst for s in group]
        if len(dsts) < 2 or len(set(dsts)) != len(dsts) or key in refused or \
                len({step.get(id(x)) for x in (*group, *(recvs[(root, s.tag)]
                                                        for s in group))}) > 1:
            continue
        members = tuple(sorted({root, *dsts}))
        swap[root][("send", group[0].tag)] = (True, members, key, group[0])
        for send in group[1:]:
            swap[root][("send", send.tag)] = None
        for send in group:
            swap[send.dst][("recv", root, send.tag)] = (False, members, key, group[0])
    out = []
    for rank, code in enumerate(ranks):
        if not swap[rank]:
            out.append(code)
            continue
        new: list[Instruction] = []
        for ins in code:
            at = ("send", ins.tag) if isinstance(ins, Send) else \
                ("recv", ins.src, ins.tag) if isinstance(ins, Recv) else None
            if at is None or at not in swap[rank]:
                new.append(ins)
            elif (how := swap[rank][at]) is not None:
                root, members, key, first = how
                if root:
                    recv = recvs[(rank, first.tag)]
                    new.append(Broadcast(None, first.var, first.slices, rank, members,
                                         recv.shape, recv.dtype, key))
                else:
                    assert isinstance(ins, Recv), ins
                    new.append(Broadcast(ins.var, None, (), key.via[1], members, ins.shape,
                                         ins.dtype, key))
        out.append(new)
    return out


def _stuck(ranks: list[list[Instruction]]) -> set[tuple]:
    """What ranks wait in forever (collective keys, or ("recv", src, tag)) when the code
    runs with blocking receives and collectives; empty: it finishes."""
    return set(replay(ranks).stuck.values())


def _members(kind: CollectiveKind, key: Key, members: list[tuple[int, Assemble, Pattern]]
             ) -> tuple[int, ...] | None:
    """The members in collective order, when exactly the ranks holding the pieces take part."""
    sources = sorted({r for _, r in key.via})
    if len(members) < 2 or sorted(r for r, _, _ in members) != sources:
        return None
    if kind is CollectiveKind.ALL_REDUCE:
        return tuple(sources)
    if kind is CollectiveKind.ALL_GATHER:
        orders = {(tuple(p.ranks), p.slots) for _, _, p in members}
        return orders.pop()[0] if len(orders) == 1 else None
    if kind is CollectiveKind.ALL_TO_ALL and len({tuple(p.ranks) for _, _, p in members}) != 1:
        return None
    by_chunk = sorted((p.chunk, r) for r, _, p in members)
    if [c for c, _ in by_chunk] != list(range(len(members))):
        return None
    return tuple(r for _, r in by_chunk)


def _collective(ins: Assemble, members: tuple[int, ...]) -> Instruction:
    p = ins.pattern
    assert p is not None, ins
    if p.kind is CollectiveKind.ALL_REDUCE:
        return AllReduce((ins.var,), (p.local,), members, (ins.shape,), ins.dtype, (p.key,))
    if p.kind is CollectiveKind.ALL_GATHER:
        return AllGather((ins.var,), (p.local[0],), members, (ins.shape,), ins.dtype, (p.dim,),
                         (p.key,), slots=p.slots)
    if p.kind is CollectiveKind.ALL_TO_ALL:
        return AllToAll(ins.var, p.local[0], tuple(p.ranks), members, ins.shape, ins.dtype,
                        p.dim, p.split, p.key)
    return ReduceScatter((ins.var,), (p.local,), members, (ins.shape,), ins.dtype, (p.dim,),
                         (p.key,))


def coalesce(ranks: list[list[Instruction]], kinds: tuple[type, ...] = MULTI,
             ) -> list[list[Instruction]]:
    """Back-to-back all-reduces (or all-gathers, or reduce-scatters: ``kinds``) over the same
    ranks and dtype become one flat buffer, where they are back to back on every member rank
    (so all members merge alike)."""
    adjacent: dict[tuple, set[int]] = defaultdict(set)  # (key a, key b) -> ranks
    for rank, code in enumerate(ranks):
        for a, b in zip(code, code[1:]):
            if isinstance(a, kinds) and isinstance(a, MULTI) and isinstance(b, type(a)):
                adjacent[(a.keys[-1], b.keys[0])].add(rank)
    out = []
    for code in ranks:
        merged: list[Instruction] = []
        for ins in code:
            prev = merged[-1] if merged else None
            if (isinstance(ins, kinds) and isinstance(ins, MULTI) and isinstance(prev, type(ins))
                    and prev.ranks == ins.ranks and prev.dtype == ins.dtype
                    and getattr(prev, "slots", ()) == getattr(ins, "slots", ())
                    and adjacent[(prev.keys[-1], ins.keys[0])] == set(ins.ranks)):
                merged[-1] = flat([(x, k) for x in (prev, ins) for k in range(len(x.vars))])
            else:
                merged.append(ins)
        out.append(merged)
    return out


def _drop_unread(ranks: list[list[Instruction]]) -> list[list[Instruction]]:
    """Sums and loads nobody reads, and receives nobody reads with their sends, until none
    is left: what a read lowered as messages after its collective was refused made for
    the collective alone (a partial sum of this rank's pieces, the loss another rank
    sums with rank 0), and the messages only those read."""
    while True:
        read = [{var for ins in code for var in reads(ins)} for code in ranks]
        dead = {(r, ins.tag) for r, code in enumerate(ranks) for ins in code
                if isinstance(ins, Recv) and ins.var not in read[r]}
        kept = [[ins for ins in code
                 if not (isinstance(ins, (Assemble, Load)) and ins.var not in read[rank])
                 and not (isinstance(ins, Recv) and (rank, ins.tag) in dead)
                 and not (isinstance(ins, Send) and (ins.dst, ins.tag) in dead)]
                for rank, code in enumerate(ranks)]
        if sum(map(len, kept)) == sum(map(len, ranks)):
            return ranks
        ranks = kept
