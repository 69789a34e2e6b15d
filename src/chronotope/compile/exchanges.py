"""Expert parallelism's dispatch and combine, each one all-to-all over its members.

Lowering writes each routed message (``Rows``: only the rows a router sent to one
member's experts) as a send and a receive marked with the exchange it is part of: a
tensor's rows dispatched to a group's experts (tokens, their routing and weights, the
gradients of what the experts made) or combined back from them (what they made, the
gradients of their tokens and weights). As messages they cannot run: every member
sends to every other before it receives, which NCCL cannot match pair by pair, and a
receive posted early does not know how many rows come. On each member, an exchange's
messages become one ``Exchange``, an all-to-all whose sizes travel first (but for a
combine's: its own routing says them), run as soon as what it sends is made. The
exchanges of one route that move the same rows (tokens, routing and weights; the
gradients of tokens and weights) go in one call, their rows side by side, where that
call can still run before any of them is read.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from chronotope.compile.program import (
    Exchange,
    Instruction,
    Key,
    Recv,
    Send,
    first_reads,
    reads,
    writes,
)


def exchanges(ranks: list[list[Instruction]]) -> tuple[list[list[Instruction]], set[Key]]:
    """Every rank's routed messages written as the exchanges they are part of, and the
    keys of those that cannot be (what they send is made after what they receive is
    read: the pieces run in another order on some member)."""
    found: dict[Key, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, code in enumerate(ranks):
        for i, ins in enumerate(code):
            if isinstance(ins, (Send, Recv)) and ins.rows is not None:
                assert ins.rows.key is not None, ins
                found[ins.rows.key][rank].append(i)
    made: list[list[tuple[Exchange, int, int]]] = [[] for _ in ranks]  # (it, where, used)
    refused: set[Key] = set()
    # where each local tensor is made and first read, per rank: every exchange asks
    made_at = [{v: i for i, ins in enumerate(code) for v in writes(ins)} for code in ranks]
    read_at = [first_reads(code) for code in ranks]
    for key, by_rank in found.items():
        for members in _groups(ranks, by_rank):
            for rank in members:
                code = ranks[rank]
                for slot, (sends, recvs) in enumerate(_slots(code, by_rank[rank], members)):
                    exchange = Exchange(sends, recvs, members,
                                        key.marked(("slot", slot)) if slot else key)
                    where, used = _where(code, by_rank[rank], exchange, made_at[rank],
                                         read_at[rank])
                    if where > used:
                        refused.add(key)
                    made[rank].append((exchange, where, used))
    if refused or not found:
        return ranks, refused
    placed: list[dict[int, list[Exchange]]] = [defaultdict(list) for _ in ranks]
    for rank, exchanges_of_rank in enumerate(made):
        for exchange, where in _packed(exchanges_of_rank):
            placed[rank][where].append(exchange)
    out = []
    for rank, code in enumerate(ranks):
        dropped = {i for at in found.values() for i in at.get(rank, ())}
        new: list[Instruction] = []
        for i, ins in enumerate(code):
            new += placed[rank].get(i, [])
            if i not in dropped:
                new.append(ins)
        new += placed[rank].get(len(code), [])
        out.append(new)
    return out, refused


def _slots(code: list[Instruction], at: list[int], members: tuple[int, ...]
           ) -> list[tuple[tuple[Send, ...], tuple[Recv, ...]]]:
    """A rank's messages of one exchange, as the calls they make: where it holds several
    pieces of the tokens (a zigzag's two sequence chunks), one call for each, the n-th
    message with each member (by tag, the same on both sides) in the n-th call."""
    sends: dict[int, list[Send]] = defaultdict(list)
    recvs: dict[int, list[Recv]] = defaultdict(list)
    for i in sorted(at, key=lambda i: code[i].tag):  # type: ignore[union-attr]
        ins = code[i]
        if isinstance(ins, Send):
            sends[members.index(ins.dst)].append(ins)
        elif isinstance(ins, Recv):
            recvs[members.index(ins.src)].append(ins)
    count = max(max(map(len, sends.values()), default=0),
                max(map(len, recvs.values()), default=0))
    return [(tuple(s[n] for _, s in sorted(sends.items()) if n < len(s)),
             tuple(r[n] for _, r in sorted(recvs.items()) if n < len(r))) for n in range(count)]


def _groups(ranks: list[list[Instruction]], by_rank: dict[int, list[int]]
            ) -> list[tuple[int, ...]]:
    """The ranks that exchange messages of one key with each other, group by group."""
    parent = {r: r for r in by_rank}

    def root(r: int) -> int:
        while parent[r] != r:
            r = parent[r]
        return r

    for rank, at in by_rank.items():
        for i in at:
            ins = ranks[rank][i]
            assert isinstance(ins, (Send, Recv))
            peer = ins.dst if isinstance(ins, Send) else ins.src
            parent[root(peer)] = root(rank)
    groups: dict[int, list[int]] = defaultdict(list)
    for r in sorted(by_rank):
        groups[root(r)].append(r)
    return [tuple(g) for g in groups.values()]


def _joined(exchanges: list[Exchange]) -> Exchange:
    """Exchanges of the same rows between the same members as one, in an order every
    member takes (by tensor)."""
    if len(exchanges) == 1:
        return exchanges[0]
    exchanges = sorted(exchanges, key=lambda e: e.key.marks[0][0])
    first = exchanges[0].key
    names = "+".join(e.key.marks[0][0] for e in exchanges)
    return Exchange(tuple(s for e in exchanges for s in e.sends),
                    tuple(r for e in exchanges for r in e.recvs), exchanges[0].ranks,
                    replace(first, marks=((names, first.marks[0][1]), *first.marks[1:])))


def _where(code: list[Instruction], at: list[int], exchange: Exchange,
           made_at: dict[str, int], read_at: dict[str, int]) -> tuple[int, int]:
    """Where on its rank an exchange runs (it stands before that instruction), and where
    what it receives is first read (it cannot run later): as soon as what it sends is
    made, so that it runs while the rank computes (``overlap`` waits on it where it is
    read); one that sends nothing, where it first received. ``made_at``, ``read_at``:
    where the rank makes each tensor and first reads it."""
    if exchange.sends:
        where = 1 + max((made_at[v] for v in reads(exchange) if v in made_at), default=-1)
    else:
        where = min(i for i in at if isinstance(code[i], Recv))
    used = min((read_at[v] for v in exchange.vars if v in read_at), default=len(code))
    return where, used


def _packed(made: list[tuple[Exchange, int, int]]) -> list[tuple[Exchange, int]]:
    """A rank's exchanges, those of one route (tokens, their routing and weights; the
    gradients of tokens and weights) that move the same rows between the same members
    as one call, their rows side by side, where it can run before any of them is read;
    each with where it runs."""
    routes: dict[tuple, list[tuple[Exchange, int, int]]] = defaultdict(list)
    for exchange, where, used in made:
        key = exchange.key
        messages: list[Send | Recv] = [*exchange.sends, *exchange.recvs]
        rows = tuple((m.rows.lo, m.rows.hi, m.rows.index) for m in messages if m.rows)
        peers = tuple(s.dst for s in exchange.sends) + tuple(r.src for r in exchange.recvs)
        routes[(key.via, key.marks[0][1], key.marks[1:], exchange.ranks, peers, rows)].append(
            (exchange, where, used))
    out = []
    for alike in routes.values():
        alike.sort(key=lambda e: e[1])
        calls: list[list[tuple[Exchange, int, int]]] = []  # each runs before any is read
        for made_one in alike:
            if calls and made_one[1] <= min(u for _, _, u in calls[-1]):
                calls[-1].append(made_one)
            else:
                calls.append([made_one])
        for call in calls:
            out.append((_joined([e for e, _, _ in call]), max(w for _, w, _ in call)))
    return out
