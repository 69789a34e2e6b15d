"""One engine that plays compiled per-rank code against itself.

Each rank runs its instructions in order on its own clock. A send never blocks; a
message travels once it is sent and its receive is posted (NCCL's rendezvous: the
bytes need a place to go), and the receive waits for it; a collective starts when
its last member calls it,
and the members of a process group meet in its collectives in the order they call
them, as torch.distributed does (the n-th call of each must be the same one). A
receive or collective with a handle is only started where it stands, and the rank
waits for it at its ``Wait``. What each step costs comes from a ``Costs``: the
simulator's prices, or none at all for the compiler's question of whether the code
runs through. A rank that cannot move on when no other can is stuck: the replay
names where.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field

from chronotope.compile.program import (
    COLLECTIVES,
    MULTI,
    STARTED,
    Collective,
    GatherParams,
    Instruction,
    Key,
    PullParam,
    PushParam,
    Recv,
    Send,
    Wait,
)

_COMMUNICATES = frozenset({Send, PushParam, Recv, PullParam, Wait, GatherParams, *COLLECTIVES})


class Costs:
    """What each step takes: nothing, unless a subclass prices it (``compile.simulate``)."""

    # The kinds of local instruction ``local`` may price (None: any); the replay skips the
    # others (the compiler replays millions of them).
    priced: frozenset[type] | None = None

    def local(self, rank: int, ins: Instruction, since: float) -> float:
        return 0.0

    def message(self, src: int, dst: int, nbytes: float, ready: float, since: float,
                ) -> tuple[float, float]:
        """(arrival, duration) of ``nbytes`` sent from ``src`` at ``ready``."""
        return ready, 0.0

    def collective(self, ins: Instruction, start: float, busy: float) -> tuple[float, float]:
        """(start, end) of a collective whose last member arrived at ``start``, after
        ``busy`` seconds of compute since the members last communicated."""
        return start, start

    def contended(self, rank: int, seconds: float) -> float:
        """What a rank loses when communication ran for ``seconds`` while it computed (on
        CPUs both take the same cores)."""
        return 0.0


def collective_key(ins: Collective | GatherParams) -> Key | tuple:
    """What names a collective call, the same on every member."""
    if isinstance(ins, GatherParams):
        return ("gather_params", ins.ranks, tuple(name for name, _, _ in ins.params))
    return ins.keys[0] if isinstance(ins, MULTI) else ins.key


@dataclass
class Replayed:
    clock: list[float]  # when each rank is done
    compute: list[float]
    comm: list[float]  # waiting on bytes while they travel, or in collectives
    stuck: dict[int, tuple] = field(default_factory=dict)  # rank -> what it waits on forever
    # (src, dst, tag) of every message, by when it was sent (ties: in causal order)
    sends: list[tuple[int, int, int]] = field(default_factory=list)
    # with ``spans``: (rank, instruction, start, end) of every local instruction, in the
    # order they ran
    spans: list[tuple[int, Instruction, float, float]] = field(default_factory=list)

    @property
    def runs_through(self) -> bool:
        return not self.stuck


def replay(ranks: list[list[Instruction]], costs: Costs | None = None,
           start: list[float] | None = None, spans: bool = False) -> Replayed:
    """Play ``ranks`` (one instruction list per rank) from ``start`` (each rank's clock);
    ``spans``: record when each local instruction ran."""
    return _Engine(ranks, costs or Costs(), start, spans).run()


class _Engine:
    def __init__(self, ranks: list[list[Instruction]], costs: Costs,
                 start: list[float] | None, spans: bool) -> None:
        self.ranks, self.costs = ranks, costs
        # local steps that take no time and are not recorded are stepped over, without a
        # call: every kind the costs never price, unless spans are recorded
        priced = None if spans else frozenset() if type(costs).local is Costs.local \
            else costs.priced
        self.skipped = set() if priced is None else {
            kind for code in ranks for kind in map(type, code)
            if kind not in _COMMUNICATES and kind not in priced}
        self.record = spans
        n = len(ranks)
        self.clock = list(start) if start is not None else [0.0] * n
        self.compute = [0.0] * n
        self.comm = [0.0] * n
        self.since = [0.0] * n  # compute since the rank last communicated (profiles price it)
        self.sizes: dict[tuple[int, int, int], float] = {}  # bytes, as the receiver expects
        for r, code in enumerate(ranks):
            for ins in code:
                if isinstance(ins, Recv):
                    self.sizes[(ins.src, r, ins.tag)] = math.prod(ins.shape) * ins.dtype.itemsize
                elif isinstance(ins, PullParam):
                    self.sizes[(ins.src, r, ins.tag)] = ins.region.numel * ins.dtype.itemsize
        self.sent: dict[tuple[int, int, int], tuple[float, float]] = {}  # -> (clock, since)
        self.posted: dict[tuple[int, int, int], float] = {}  # receive -> when posted
        self.arrived: dict[tuple[int, int, int], tuple[float, float]] = {}  # (arrival, took)
        self.order: list[tuple[int, int, int]] = []
        self.calls: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)  # rank, group
        self.met: dict[tuple, dict[int, tuple]] = defaultdict(dict)  # (group, n) -> rank -> ...
        self.done: dict[tuple, tuple[float, float]] = {}  # (group, n) -> (start, end)
        self.started: list[dict[str, tuple]] = [{} for _ in ranks]  # handle -> what it awaits
        self.calling: dict[int, tuple] = {}  # rank -> the call it made and waits in now
        self.waiting: dict[int, tuple] = {}  # rank -> what it is blocked on, as stuck names it
        self.spans: list[tuple[int, Instruction, float, float]] = []
        # per rank, its compute runs as (start, end, compute before the run): how much it
        # computed while a transfer ran
        self.runs: list[list[tuple[float, float, float]]] = [[] for _ in ranks]

    def run(self) -> Replayed:
        pc = [0] * len(self.ranks)
        skipped = self.skipped
        moved = True
        while moved:
            moved = False
            for r, code in enumerate(self.ranks):
                at = pc[r]
                while at < len(code) and (type(code[at]) in skipped or self.step(r, code[at])):
                    at += 1
                moved |= at > pc[r]
                pc[r] = at
        stuck = {r: self.waiting[r] for r, code in enumerate(self.ranks) if pc[r] < len(code)}
        order = sorted(range(len(self.order)), key=lambda i: (self.sent[self.order[i]][0], i))
        return Replayed(self.clock, self.compute, self.comm, stuck,
                        [self.order[i] for i in order], self.spans)

    def step(self, r: int, ins: Instruction) -> bool:
        """Run ``ins`` on rank ``r``; False if it must wait here."""
        if type(ins) not in _COMMUNICATES:  # most are: one lookup, not a chain of isinstance
            self.local(r, ins)
            return True
        if isinstance(ins, (Send, PushParam)):
            key = (r, ins.dst, ins.tag)
            self.sent[key] = (self.clock[r], self.since[r])
            self.order.append(key)
            self.since[r] = 0.0
            return True
        awaited: tuple
        if isinstance(ins, (Recv, PullParam)):
            awaited = ("recv", ins.src, ins.tag)
            self.posted.setdefault((ins.src, r, ins.tag), self.clock[r])
        elif isinstance(ins, (*COLLECTIVES, GatherParams)):
            awaited = self.calling.pop(r) if r in self.calling else self.call(r, ins)
        else:
            assert isinstance(ins, Wait), ins  # (the last kind of ``_COMMUNICATES``)
            if ins.landing:  # a ring gather's outputs, read as they land: waited after
                return True
            if not self.finish(r, self.started[r][ins.handle]):
                return False
            del self.started[r][ins.handle]
            return True
        if isinstance(ins, STARTED) and ins.handle is not None:
            self.started[r][ins.handle] = awaited
            return True
        if self.finish(r, awaited):
            return True
        if awaited[0] == "call":
            self.calling[r] = awaited
        return False

    def local(self, r: int, ins: Instruction) -> None:
        """Rank ``r`` runs ``ins``, which waits on no other rank."""
        seconds = self.costs.local(r, ins, self.since[r])
        if self.record:
            self.spans.append((r, ins, self.clock[r], self.clock[r] + seconds))
        if seconds > 0:
            self.runs[r].append((self.clock[r], self.clock[r] + seconds, self.compute[r]))
        self.clock[r] += seconds
        self.compute[r] += seconds
        self.since[r] += seconds

    def call(self, r: int, ins: Collective | GatherParams) -> tuple:
        """Rank ``r`` calls collective ``ins``: its place among its group's calls."""
        # Ranks past those played are replicas of rank ``g % len(ranks)`` (a scaled plan's
        # unit): they run the same code, so they meet it there.
        group = tuple(sorted({g % len(self.ranks) for g in ins.ranks}))
        n = self.calls[(r, group)]
        self.calls[(r, group)] += 1
        self.met[(group, n)][r] = (type(ins), collective_key(ins), self.clock[r], self.since[r],
                                   ins)
        return ("call", (group, n), collective_key(ins))

    def contended(self, r: int, start: float, end: float) -> float:
        """What rank ``r`` loses for computing while a transfer ran from ``start`` to
        ``end`` (the costs say what such sharing takes; both finish that much later),
        counted as time spent communicating."""
        lost = self.costs.contended(r, max(0.0, self.computed(r, min(end, self.clock[r]))
                                           - self.computed(r, start)))
        self.comm[r] += lost
        return lost

    def computed(self, r: int, t: float) -> float:
        """Seconds rank ``r`` had computed by time ``t``."""
        runs = self.runs[r]
        k = bisect_right(runs, (t, math.inf)) - 1
        if k < 0:
            return 0.0
        start, end, before = runs[k]
        return before + min(t, end) - start

    def finish(self, r: int, awaited: tuple) -> bool:
        """Rank ``r`` waits until what it ``awaited`` has happened; False: not yet."""
        if awaited[0] == "recv":
            key = (awaited[1], r, awaited[2])
            if key not in self.sent:
                self.waiting[r] = awaited
                return False
            if key not in self.arrived:
                ready, since = self.sent[key]
                self.arrived[key] = self.costs.message(key[0], r, self.sizes.get(key, 0.0),
                                                       max(ready, self.posted[key]), since)
            arrival, took = self.arrived[key]
            self.comm[r] += min(max(0.0, arrival - self.clock[r]), took)
            lost = self.contended(r, arrival - took, arrival)
            self.clock[r] = max(self.clock[r], arrival) + lost
        else:
            _, call, key = awaited
            if call not in self.done:
                met = self.met[call]
                if len(met) < len(call[0]) or len({m[:2] for m in met.values()}) > 1:
                    self.waiting[r] = key
                    return False
                first = next(iter(met.values()))
                self.done[call] = self.costs.collective(first[4], max(m[2] for m in met.values()),
                                                        max(m[3] for m in met.values()))
            start, end = self.done[call]
            self.comm[r] += max(0.0, end - max(start, self.clock[r]))
            lost = self.contended(r, start, end)
            self.clock[r] = max(self.clock[r], end) + lost
        self.waiting.pop(r, None)
        self.since[r] = 0.0
        return True
