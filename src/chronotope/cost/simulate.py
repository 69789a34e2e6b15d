"""Replay a compiled Program on a cost model: step time, compute, communication and
bubble per device, without running it.

Each rank's instructions run in order on its own clock. A piece costs its FLOPs
at the device's peak (or its share of its op's measured time, plus what the
runtime adds per instruction as ``cost.calibrate`` fitted it); a message leaves
when its sender reaches the ``Send`` and takes the link's alpha-beta time, one
at a time per sending and receiving device and per node network; a receive
waits for it; a collective starts when its last member arrives (and, crossing nodes,
when their networks are free) and takes what ``Cluster.collective`` says. Waiting on a
message longer than it travels, or on a collective's late members, is bubble. After
the step, the optimizer reads and writes each owned parameter a few times (memory
bound, or as calibrated), and
the refresh of stored copies runs like the step. A profiled cluster prices each
call by the compute its members did since they last communicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chronotope.compile.collectives import collective_key
from chronotope.compile.program import (
    COLLECTIVES,
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Free,
    GatherParams,
    Program,
    PullParam,
    PushParam,
    Recv,
    ReduceScatter,
    Send,
)
from chronotope.cost.measure import Calibration, OpTime, instruction_compute
from chronotope.cost.network import Cluster
from chronotope.errors import PlanError

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
             dtype: str = "float32", calibration: Calibration | None = None) -> Simulation:
    """Predicted times of one training step of ``program`` on ``cluster``, pieces from
    ``measured`` op times (with what the runtime adds, as ``cost.calibrate`` fits it)
    or FLOPs at the peak."""
    calibration = calibration or Calibration()
    if cluster.ndevices < program.ndevices:
        raise PlanError(f"cluster {cluster.name} has {cluster.ndevices} devices and the "
                        f"program {program.ndevices}")
    params = program.plan.graph.params
    state = _Replay(program.ndevices, cluster, measured, cluster.peak(dtype), params,
                    calibration)
    state.run(program.ranks)
    per_byte = calibration.optimizer_per_byte or OPTIMIZER_PASSES / cluster.copy_bandwidth
    for rank, owned in enumerate(program.owned):
        nbytes = sum(o.region.numel * params[name].dtype.itemsize
                     for name, regions in owned.items() for o in regions)
        seconds = per_byte * nbytes
        state.clock[rank] += seconds
        state.compute[rank] += seconds
    state.run(program.refresh)
    checked = program.plan.check()
    end = max(state.clock)
    return Simulation(cluster.name, [
        RankTimes(r, state.clock[r], state.compute[r], state.comm[r],
                  max(0.0, end - state.compute[r] - state.comm[r]), checked.memory[r].total)
        for r in range(program.ndevices)])


class _Replay:
    def __init__(self, n: int, cluster: Cluster, measured, peak: float, params: dict,
                 calibration: Calibration):
        self.params, self.calibration = params, calibration
        self.cluster, self.measured, self.peak = cluster, measured, peak
        self.clock = [0.0] * n
        self.compute = [0.0] * n
        self.comm = [0.0] * n
        self.since = [0.0] * n  # compute since the rank last communicated (profiles price it)
        self.free: dict[tuple, float] = {}  # link resources: when each is free again

    def run(self, ranks: list[list]) -> None:
        sizes = {}  # (src, dst, tag) -> bytes, as the receiver expects them
        for r, code in enumerate(ranks):
            for ins in code:
                if isinstance(ins, Recv):
                    sizes[(ins.src, r, ins.tag)] = math.prod(ins.shape) * ins.dtype.itemsize
                elif isinstance(ins, PullParam):
                    sizes[(ins.src, r, ins.tag)] = ins.region.numel * ins.dtype.itemsize
        pc = [0] * len(ranks)
        sent: dict[tuple[int, int, int], tuple[float, float]] = {}  # -> (arrival, duration)
        arrived: dict[tuple, dict[int, tuple[float, float]]] = {}  # -> rank: (clock, since)
        done: dict[tuple, tuple[float, float]] = {}  # collective -> (start, end)
        moved = True
        while moved:
            moved = False
            for r, code in enumerate(ranks):
                while pc[r] < len(code):
                    ins = code[pc[r]]
                    if isinstance(ins, (Send, PushParam)):
                        self._send(r, ins.dst, ins.tag, sizes.get((r, ins.dst, ins.tag), 0.0),
                                   sent)
                        self.since[r] = 0.0
                    elif isinstance(ins, (Recv, PullParam)):
                        got = sent.get((ins.src, r, ins.tag))
                        if got is None:
                            break
                        arrival, duration = got
                        wait = max(0.0, arrival - self.clock[r])
                        self.comm[r] += min(wait, duration)
                        self.clock[r] = max(self.clock[r], arrival)
                        self.since[r] = 0.0
                    elif isinstance(ins, (*COLLECTIVES, GatherParams)):
                        key = _key(ins)
                        arrived.setdefault(key, {}).setdefault(r, (self.clock[r],
                                                                   self.since[r]))
                        if key not in done:
                            if len(arrived[key]) < len(ins.ranks):
                                break
                            start = max(clock for clock, _ in arrived[key].values())
                            busy = max(since for _, since in arrived[key].values())
                            done[key] = self._network(ins.ranks, start,
                                                      self._collective(ins, busy))
                        start, end = done[key]
                        self.comm[r] += end - start
                        self.clock[r] = end
                        self.since[r] = 0.0
                    else:
                        seconds = self._local(ins)
                        self.clock[r] += seconds
                        self.compute[r] += seconds
                        self.since[r] += seconds
                    pc[r] += 1
                    moved = True
        stuck = [r for r, code in enumerate(ranks) if pc[r] < len(code)]
        if stuck:
            raise PlanError(f"ranks {stuck} wait forever in the replay (at "
                            f"{ranks[stuck[0]][pc[stuck[0]]]!r:.120})")

    def _send(self, r: int, dst: int, tag: int, nbytes: float, sent: dict) -> None:
        if "send" in self.cluster.fitted and self.cluster.node(r) == self.cluster.node(dst):
            duration = self.cluster.measured("send", nbytes, 2, self.since[r])
        else:
            duration = self.cluster.link(r, dst).seconds("send", 2, nbytes)
        busy = [("out", r), ("in", dst)]
        if self.cluster.node(r) != self.cluster.node(dst):
            busy += [("net out", self.cluster.node(r)), ("net in", self.cluster.node(dst))]
        start = self._take(busy, self.clock[r], duration)
        sent[(r, dst, tag)] = (start + duration, duration)

    def _network(self, ranks, start: float, duration: float) -> tuple[float, float]:
        """(start, end) of a collective: one that crosses nodes waits for their networks,
        which carry one cross-node transfer at a time (two groups' rings share them)."""
        nodes = {self.cluster.node(r) for r in ranks}
        links = [(way, n) for n in nodes for way in ("net out", "net in")] \
            if len(nodes) > 1 else []
        start = self._take(links, start, duration)
        return start, start + duration

    def _take(self, links: list[tuple], ready: float, duration: float) -> float:
        """Hold ``links`` for ``duration`` from when they are all free, ``ready`` at the
        earliest: when the transfer starts."""
        start = max([ready, *(self.free.get(x, 0.0) for x in links)])
        for x in links:
            self.free[x] = start + duration
        return start

    def _collective(self, ins, busy: float) -> float:
        kind, nbytes = _priced(ins, self.params)
        return self.cluster.collective(kind, nbytes, [tuple(ins.ranks)], busy)

    def _local(self, ins) -> float:
        if isinstance(ins, Free):
            return 0.0
        compute = instruction_compute(ins, self.measured, self.peak)
        return self.calibration.seconds(ins, compute, self.cluster.copy_bandwidth)


def _key(ins) -> tuple:
    if isinstance(ins, GatherParams):
        return ("gather_params", ins.ranks, tuple(name for name, _, _ in ins.params))
    return collective_key(ins)


def _priced(ins, params: dict) -> tuple[str, float]:
    """The collective's kind and the bytes each member holds (as ``Cluster`` counts them)."""
    size = ins.dtype.itemsize if hasattr(ins, "dtype") else 0
    if isinstance(ins, AllReduce):
        return "all_reduce", sum(math.prod(s) for s in ins.shapes) * size
    if isinstance(ins, AllGather):
        return "all_gather", math.prod(ins.shape) * size
    if isinstance(ins, ReduceScatter):
        return "reduce_scatter", math.prod(ins.shape) * len(ins.ranks) * size
    if isinstance(ins, AllToAll):
        return "all_to_all", math.prod(ins.shape) * size
    if isinstance(ins, Broadcast):
        return "broadcast", math.prod(ins.shape) * size
    if isinstance(ins, GatherParams):
        return "all_gather", sum(math.prod(b - a for a, b in region) * params[name].dtype.itemsize
                                 for name, region, _ in ins.params)
    raise PlanError(f"not a collective: {ins!r:.80}")
