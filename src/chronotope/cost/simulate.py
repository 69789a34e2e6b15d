"""Replay a compiled Program on a cost model: step time, compute, communication and
bubble per device, without running it.

Each rank's instructions run in order on its own clock. A piece costs its FLOPs
at the device's peak (or its share of its op's measured time); a message leaves
when its sender reaches the ``Send`` and takes the link's alpha-beta time, one
at a time per sending and receiving device and per node network; a receive
waits for it; a collective starts when its last member arrives and takes what
``Cluster.collective`` says. Waiting on a message longer than it travels, or on
a collective's late members, is bubble. After the step, the optimizer reads and
writes each owned parameter a few times (memory bound), and the refresh of
stored copies runs like the step.
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
    Assemble,
    Backward,
    Broadcast,
    Forward,
    Free,
    GatherParams,
    Program,
    PullParam,
    PushParam,
    Recv,
    ReduceScatter,
    Send,
    WeightGrad,
)
from chronotope.cost.compute import piece_flops
from chronotope.cost.measure import Calibration, OpTime, piece_seconds
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
             dtype: str = "float32", slowdown: float = 1.0,
             calibration: Calibration | None = None) -> Simulation:
    """Predicted times of one training step of ``program`` on ``cluster``, pieces from
    ``measured`` op times (scaled and with the runtime's time per instruction, as
    ``cost.calibrate`` fits them) or FLOPs at the peak; ``slowdown`` scales both
    (ranks sharing cores)."""
    calibration = calibration or Calibration(0.0, 1.0)
    if cluster.ndevices < program.ndevices:
        raise PlanError(f"cluster {cluster.name} has {cluster.ndevices} devices and the "
                        f"program {program.ndevices}")
    params = program.plan.graph.params
    state = _Replay(program.ndevices, cluster, measured, cluster.peak(dtype),
                    slowdown * calibration.compute_scale, params,
                    calibration.per_instruction * slowdown)
    state.run(program.ranks)
    for rank, owned in enumerate(program.owned):
        nbytes = sum(o.region.numel * params[name].dtype.itemsize
                     for name, regions in owned.items() for o in regions)
        seconds = OPTIMIZER_PASSES * nbytes / cluster.copy_bandwidth * slowdown
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
    def __init__(self, n: int, cluster: Cluster, measured, peak: float, slowdown: float,
                 params: dict, overhead: float):
        self.params, self.overhead = params, overhead
        self.cluster, self.measured, self.peak, self.slowdown = cluster, measured, peak, slowdown
        self.clock = [0.0] * n
        self.compute = [0.0] * n
        self.comm = [0.0] * n
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
        started: list[set[int]] = [set() for _ in ranks]
        sent: dict[tuple[int, int, int], tuple[float, float]] = {}  # -> (arrival, duration)
        arrived: dict[tuple, dict[int, float]] = {}
        done: dict[tuple, tuple[float, float]] = {}  # collective -> (start, end)
        moved = True
        while moved:
            moved = False
            for r, code in enumerate(ranks):
                while pc[r] < len(code):
                    ins = code[pc[r]]
                    if not isinstance(ins, Free) and pc[r] not in started[r]:
                        started[r].add(pc[r])  # the runtime's own time, once per instruction
                        self.clock[r] += self.overhead
                        self.compute[r] += self.overhead
                    if isinstance(ins, (Send, PushParam)):
                        self._send(r, ins.dst, ins.tag, sizes.get((r, ins.dst, ins.tag), 0.0),
                                   sent)
                    elif isinstance(ins, (Recv, PullParam)):
                        got = sent.get((ins.src, r, ins.tag))
                        if got is None:
                            break
                        arrival, duration = got
                        wait = max(0.0, arrival - self.clock[r])
                        self.comm[r] += min(wait, duration)
                        self.clock[r] = max(self.clock[r], arrival)
                    elif isinstance(ins, (*COLLECTIVES, GatherParams)):
                        key = _key(ins)
                        arrived.setdefault(key, {}).setdefault(r, self.clock[r])
                        if key not in done:
                            if len(arrived[key]) < len(ins.ranks):
                                break
                            start = max(arrived[key].values())
                            done[key] = (start, start + self._collective(ins))
                        start, end = done[key]
                        self.comm[r] += end - start
                        self.clock[r] = end
                    else:
                        seconds = self._local(ins)
                        self.clock[r] += seconds
                        self.compute[r] += seconds
                    pc[r] += 1
                    moved = True
        stuck = [r for r, code in enumerate(ranks) if pc[r] < len(code)]
        if stuck:
            raise PlanError(f"ranks {stuck} wait forever in the replay (at "
                            f"{ranks[stuck[0]][pc[stuck[0]]]!r:.120})")

    def _send(self, r: int, dst: int, tag: int, nbytes: float, sent: dict) -> None:
        link = self.cluster.fitted.get("send") if "send" in self.cluster.fitted and \
            self.cluster.node(r) == self.cluster.node(dst) else self.cluster.link(r, dst)
        duration = link.alpha + nbytes / link.bandwidth
        busy = [("out", r), ("in", dst)]
        if self.cluster.node(r) != self.cluster.node(dst):
            busy += [("net out", self.cluster.node(r)), ("net in", self.cluster.node(dst))]
        start = max([self.clock[r], *(self.free.get(x, 0.0) for x in busy)])
        for x in busy:
            self.free[x] = start + duration
        sent[(r, dst, tag)] = (start + duration, duration)

    def _collective(self, ins) -> float:
        kind, nbytes = _priced(ins, self.params)
        return self.cluster.collective(kind, nbytes, [tuple(ins.ranks)])

    def _local(self, ins) -> float:
        if isinstance(ins, Forward):
            return self._piece(ins.op)
        if isinstance(ins, Backward):
            again = sum(self._piece(f.op) for f in ins.recompute if isinstance(f, Forward))
            return again + sum(self._piece(op) for op in ins.ops)
        if isinstance(ins, WeightGrad):
            return self._piece(ins.op)
        if isinstance(ins, Assemble) and ins.parts:
            return math.prod(ins.shape) * ins.dtype.itemsize / self.cluster.copy_bandwidth
        return 0.0

    def _piece(self, op) -> float:
        if self.measured is not None and (op.forward or op).op.name in self.measured:
            return piece_seconds(op, self.measured) * self.slowdown
        return piece_flops(op) / self.peak * self.slowdown


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
