"""Replay a compiled Program on a cost model: step time, compute, communication and
bubble per device, without running it.

Each rank's instructions run in order on its own clock (``compile/replay.py``). A
piece costs its FLOPs or the bytes it moves, whichever take longer (or its share of
its op's measured time, plus what the runtime adds per instruction as
``measure.calibrate`` fitted it); a
message leaves once its sender reaches the ``Send`` and its receive is posted, and
takes the link's alpha-beta time, one at a time per sending and receiving device
and per node network; a collective starts when its last member calls it (after the
group's earlier ones and, crossing nodes, when their networks are free) and takes
what ``Cluster.collective`` says; a started one runs while its rank computes until
the ``Wait``. Waiting on a message longer than it travels, or on a collective's late
members, is bubble. After the step, the optimizer reads and writes each owned
parameter a few times (memory bound, or as calibrated), and the refresh of stored
copies runs like the step. A profiled cluster prices each call by the compute its
members did since they last communicated.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Set
from dataclasses import dataclass

from chronotope.compile.program import (
    AllGather,
    AllReduce,
    AllToAll,
    Assemble,
    Backward,
    Broadcast,
    Exchange,
    Forward,
    Free,
    GatherParams,
    Leave,
    Program,
    ReduceScatter,
    Refill,
    WeightGrad,
)
from chronotope.compile.replay import Costs, Replayed, replay
from chronotope.cost.compute import Traffic, piece_flops
from chronotope.cost.network import Cluster
from chronotope.cost.times import Calibration, OpTime, piece_seconds
from chronotope.errors import PlanError
from chronotope.plan.check import Held
from chronotope.plan.plan import PlanOp

OPTIMIZER_PASSES = 4  # parameter, gradient and state read, parameter written: bytes moved


@dataclass(frozen=True)
class RankTimes:
    rank: int
    end: float  # seconds from the step's start until this rank is done
    compute: float
    comm: float  # in collectives, and receiving while the bytes travel
    bubble: float  # idle: waiting on others, or done before the slowest rank
    peak_memory: int  # bytes, the plan's estimate


@dataclass(frozen=True)
class Simulation:
    cluster: str
    ranks: list[RankTimes]

    @property
    def step_time(self) -> float:
        return max(r.end for r in self.ranks)

    @property
    def bubble_ratio(self) -> float:
        total = self.step_time * len(self.ranks)
        return sum(r.bubble for r in self.ranks) / total if total else 0.0


def simulate(program: Program, cluster: Cluster, measured: dict[str, OpTime] | None = None,
             calibration: Calibration | None = None) -> Simulation:
    """Predicted times of one training step of ``program`` on ``cluster``, pieces from
    ``measured`` op times (with what the runtime adds, as ``measure.calibrate`` fits it)
    or by ``Cluster.compute`` from their FLOPs and the bytes they move in the plan's dtype
    (the 16-bit tensor-core rate and 16-bit activations for a bf16 or fp16 plan)."""
    calibration = calibration or Calibration()
    if cluster.ndevices < program.ndevices:
        raise PlanError(f"cluster {cluster.name} has {cluster.ndevices} devices and the "
                        f"program {program.ndevices}")
    params = program.plan.graph.params
    traffic, dtype = Traffic(program.plan.graph, program.plan.dtype), program.plan.dtype

    def piece(op: PlanOp) -> float:
        if measured is not None and (op.forward or op).op.name in measured:
            return piece_seconds(op, measured)
        return cluster.compute(piece_flops(op), traffic.piece(op), dtype)

    prices = _Prices(cluster, piece, params, calibration,
                     Held(program.plan) if program.plan.swapped else None,
                     program.plan.swapped)
    step = _played(program.ranks, prices, [0.0] * program.ndevices)
    clock = list(step.clock)
    compute, comm = list(step.compute), list(step.comm)
    per_byte = calibration.optimizer_per_byte or OPTIMIZER_PASSES / cluster.copy_bandwidth
    for rank in range(program.ndevices):
        nbytes = sum(math.prod(b - a for a, b in index) * params[name].dtype.itemsize
                     for name, index in program.updated(rank))
        seconds = per_byte * nbytes
        clock[rank] += seconds
        compute[rank] += seconds
    after = _played(program.refresh, prices, clock)
    checked = program.plan.check()
    end = max(after.clock)
    return Simulation(cluster.name, [
        RankTimes(r, after.clock[r], compute[r] + after.compute[r], comm[r] + after.comm[r],
                  max(0.0, end - compute[r] - after.compute[r] - comm[r] - after.comm[r]),
                  checked.memory[r].total)
        for r in range(program.ndevices)])


def _played(ranks: list[list], prices: _Prices, start: list[float]) -> Replayed:
    played = replay(ranks, prices, start)
    if played.stuck:
        r, what = min(played.stuck.items())
        raise PlanError(f"ranks {sorted(played.stuck)} wait forever in the replay (rank {r} "
                        f"in {what!r:.120})")
    return played


class _Prices(Costs):
    """A cluster's prices: links and node networks carry one transfer at a time each."""

    def __init__(self, cluster: Cluster, piece: Callable[[PlanOp], float], params: dict,
                 calibration: Calibration, held: Held | None = None,
                 swapped: Set[PlanOp] = frozenset()):
        self.params, self.calibration, self.held = params, calibration, held
        self.swapped = swapped
        self.cluster, self.piece = cluster, piece
        self.links = _Timetable()  # device ports and node networks: when each is busy
        self.free: dict[tuple, float] = {}  # a group's stream: when its last call ends
        self.computed: dict[tuple, float] = {}  # by the pieces an instruction runs

    def message(self, src: int, dst: int, nbytes: float, ready: float, since: float,
                ) -> tuple[float, float]:
        if "send" in self.cluster.fitted and self.cluster.node(src) == self.cluster.node(dst):
            duration = self.cluster.measured("send", nbytes, 2, since)
        else:
            duration = self.cluster.link(src, dst).seconds("send", 2, nbytes)
        busy = [("out", src), ("in", dst)]
        if self.cluster.node(src) != self.cluster.node(dst):
            busy += [("net out", self.cluster.node(src)), ("net in", self.cluster.node(dst))]
        start = self.links.book(busy, ready, duration)
        return start + duration, duration

    def collective(self, ins, start: float, busy: float) -> tuple[float, float]:
        """A group's collectives run one at a time, in the order they were called; one
        that crosses nodes waits for their networks, which carry one cross-node transfer
        at a time (two groups' rings share them)."""
        kind, nbytes = _priced(ins, self.params)
        duration = self.cluster.collective(kind, nbytes, [tuple(ins.ranks)], busy)
        nodes = {self.cluster.node(r) for r in ins.ranks}
        links = [(way, n) for n in nodes for way in ("net out", "net in")] \
            if len(nodes) > 1 else []
        group = tuple(sorted(ins.ranks))
        start = self.links.book(links, max(start, self.free.get(group, 0.0)), duration)
        self.free[group] = start + duration
        return start, start + duration

    def contended(self, rank: int, seconds: float) -> float:
        return (1.0 - self.cluster.overlap) * seconds

    def local(self, rank: int, ins, since: float) -> float:
        """An instruction's own time; its pieces' compute priced once (a folded program
        runs one micro-batch's pieces for every micro-batch)."""
        if isinstance(ins, Free):
            return 0.0
        key = _pieces(ins)
        if key not in self.computed:
            self.computed[key] = instruction_compute(ins, self.piece)
        return self.calibration.seconds(*features(ins), self.computed[key],
                                        self.cluster.copy_bandwidth) + self._swapped(ins)

    def _swapped(self, ins) -> float:
        """Seconds of moving what swapped pieces keep to host memory after their forward
        and back before their backward (blocking copies over the device's host link)."""
        if self.held is None or not self.cluster.host_bandwidth:
            return 0.0
        if isinstance(ins, Forward) and ins.swap:
            ops = [ins.op]
        elif isinstance(ins, Backward):
            ops = [op.forward_op for op in ins.ops if op.forward in self.swapped]
        else:
            return 0.0
        return sum(self.held.swapped(op) for op in ops) / self.cluster.host_bandwidth


class _Timetable:
    """When each resource is busy, as disjoint sorted intervals. The replay settles
    transfers in the order their receivers reach them, not in time order, so a transfer
    takes the first gap long enough on all its resources at or after it is ready: one
    settled later but ready earlier does not queue behind a later one."""

    def __init__(self) -> None:
        self.starts: dict[tuple, list[float]] = defaultdict(list)
        self.ends: dict[tuple, list[float]] = defaultdict(list)

    def book(self, resources: list[tuple], ready: float, duration: float) -> float:
        """Hold ``resources`` for ``duration`` from the earliest time at or after ``ready``
        when all are free: when the transfer starts."""
        start, moved = ready, bool(resources) and duration > 0
        while moved:
            moved = False
            for x in resources:
                starts, ends = self.starts[x], self.ends[x]
                k = bisect_left(starts, start + duration) - 1  # the last to begin before the end
                if k >= 0 and ends[k] > start:
                    start, moved = ends[k], True
        if duration > 0:
            for x in resources:
                self._insert(x, start, start + duration)
        return start

    def _insert(self, x: tuple, start: float, end: float) -> None:
        starts, ends = self.starts[x], self.ends[x]
        k = bisect_left(starts, start)
        if k > 0 and ends[k - 1] >= start:  # touches the one before: extend it
            k -= 1
            ends[k] = end
        else:
            starts.insert(k, start)
            ends.insert(k, end)
        if k + 1 < len(starts) and starts[k + 1] <= ends[k]:  # touches the one after
            ends[k] = ends.pop(k + 1)
            starts.pop(k + 1)


def _priced(ins, params: dict) -> tuple[str, float]:
    """The collective's kind and the bytes each member holds (as ``Cluster`` counts them)."""
    size = ins.dtype.itemsize if hasattr(ins, "dtype") else 0
    if isinstance(ins, AllReduce):
        return "all_reduce", sum(math.prod(s) for s in ins.shapes) * size
    if isinstance(ins, AllGather):
        return "all_gather", sum(math.prod(s) for s in ins.shapes) * size
    if isinstance(ins, ReduceScatter):
        return "reduce_scatter", sum(math.prod(s) for s in ins.shapes) * len(ins.ranks) * size
    if isinstance(ins, Leave):  # a ring's steps: a reduce-scatter of the whole gathered
        return "reduce_scatter", sum(math.prod(s) for s in ins.shapes) * size
    if isinstance(ins, AllToAll):
        return "all_to_all", math.prod(ins.shape) * size
    if isinstance(ins, Exchange):  # what it receives, as a ring all-to-all's share of it
        k = len(ins.ranks)
        return "all_to_all", ins.expected_bytes() * k / max(k - 1, 1)
    if isinstance(ins, Broadcast):
        return "broadcast", math.prod(ins.shape) * size
    if isinstance(ins, GatherParams):
        return "all_gather", sum(math.prod(b - a for a, b in region) * params[name].dtype.itemsize
                                 for name, region, _ in ins.params)
    raise PlanError(f"not a collective: {ins!r:.80}")


def features(ins: object) -> tuple[str, int, int]:
    """An instruction's kind (a split backward's weight part is one more autograd call),
    the pieces an autograd call runs through, and the bytes an ``Assemble`` writes."""
    if isinstance(ins, Backward):
        return "Backward", len(ins.ops) + len(ins.recompute), 0
    if isinstance(ins, WeightGrad):
        return "Backward", 1, 0
    if isinstance(ins, Assemble):
        return "Assemble", 0, 0 if ins.is_view else math.prod(ins.shape) * ins.dtype.itemsize
    if isinstance(ins, Refill):
        return "Refill", 0, ins.nbytes
    return type(ins).__name__, 0, 0


def _pieces(ins: object) -> tuple:
    """What an instruction's compute depends on: the pieces it runs (alive while the
    program is, so their ids do not change)."""
    if isinstance(ins, (Forward, WeightGrad)):
        return (type(ins), id(ins.op))
    if isinstance(ins, Backward):
        return (Backward, *(id(op) for op in ins.ops), None,
                *(id(f.op) for f in ins.recompute if isinstance(f, Forward)))
    return (type(ins),)


def instruction_compute(ins: object, piece: Callable[[PlanOp], float]) -> float:
    """Seconds of the pieces an instruction runs, each priced by ``piece`` (a recomputing
    backward runs its forwards again first)."""
    if isinstance(ins, (Forward, WeightGrad)):
        return piece(ins.op)
    if isinstance(ins, Backward):
        return sum(piece(f.op) for f in ins.recompute if isinstance(f, Forward)) + \
            sum(piece(op) for op in ins.ops)
    return 0.0
