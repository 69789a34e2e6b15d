"""Pipeline timelines: each rank's forward, backward and weight-gradient steps, in the
plan's order, played on the compiler's replay engine (``compile.replay``).

A step (``1F0``: stage 1's forward of micro-batch 0) lasts what its pieces cost
(``cost.piece_flops`` at ``flops_per_s``, or their share of each op's measured
time, ``measure.measure_ops``) and starts when its rank is free and the steps it
reads from have ended (data edges between the pieces; steps of the same name on
other ranks of a tensor-parallel group run alongside it), plus, with
``bytes_per_s``, the time the bytes it reads from another rank take on the link.
Every receive is posted when the step begins, so bytes travel as soon as they
are made. The bubble ratio is the idle share of all ranks' compute time until the
last step ends. ``viz.save_timeline`` draws one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chronotope.compile.program import Recv, Send, Wait
from chronotope.compile.replay import Costs, replay
from chronotope.cost import OpTime, piece_flops, piece_seconds
from chronotope.errors import PlanError
from chronotope.plan import Plan
from chronotope.plan.check import Sources
from chronotope.plan.plan import placed
from chronotope.plan.steps import actions, step_of

Key = tuple[int, str]  # (rank, step)


@dataclass(frozen=True)
class Bar:
    rank: int
    step: str  # "1F0", "1B0", "1I0", "1W0"; "HF0": a step of a group that is not one stage
    start: float  # seconds
    end: float
    message: bool = False  # bytes on their way to ``step``, from the end of the sender's

    @property
    def kind(self) -> str:
        """F, B, I or W for a step; C for a message."""
        return "C" if self.message else [c for c in self.step if c in "FBIW"][-1]


@dataclass
class Timeline:
    bars: list[Bar]
    ranks: list[int]

    @property
    def makespan(self) -> float:
        return max((b.end for b in self.bars), default=0.0)

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the ranks' time up to the last step's end (messages do not count:
        they travel while the rank computes)."""
        busy = sum(b.end - b.start for b in self.bars if not b.message)
        total = self.makespan * len(self.ranks)
        return 1 - busy / total if total else 0.0


def timeline(plan: Plan, flops_per_s: float = 1e12,
             step_cost: Callable[[int, str], float] | None = None,
             measured: dict[str, OpTime] | None = None,
             bytes_per_s: float | None = None) -> Timeline:
    """The timeline of a pipeline plan (one made by ``policies.pipeline`` or ``mesh``).

    Durations are the pieces' FLOPs at ``flops_per_s``, their share of ``measured`` op
    times where given, or ``step_cost(rank, step)`` seconds where given (equal steps,
    to check a schedule's shape). ``bytes_per_s``: the link speed messages between
    ranks take (None: they take no time)."""
    times = step_times(plan, flops_per_s, step_cost, measured, bytes_per_s)
    return Timeline(_replayed(times, bytes_per_s), sorted(times.order))


@dataclass
class StepTimes:
    """What a pipeline plan's steps take: each rank's steps in order, each step's seconds
    on its rank, and the bytes each step reads from another rank's step."""

    order: dict[int, list[str]]
    cost: dict[Key, float]
    wire: dict[tuple[Key, Key], int]  # (sender step, reader step) -> bytes; 0: same rank


def step_times(plan: Plan, flops_per_s: float = 1e12,
               step_cost: Callable[[int, str], float] | None = None,
               measured: dict[str, OpTime] | None = None,
               bytes_per_s: float | None = None) -> StepTimes:
    """The steps ``timeline`` plays (its arguments, read as it reads them); the order
    search (``search/order.py``) orders them anew."""
    order = actions(plan)
    if not order:
        raise PlanError("this plan has no pipeline steps to draw: make it with "
                        "ct.policies.pipeline (or mesh with pp > 1 and micro > 1)")
    steps = step_of(plan)
    checked = plan.check()
    ops = [op for seq in checked.sequences.values() for op in seq]
    cost: dict[Key, float] = defaultdict(float)
    for op in ops:
        if op in steps:
            cost[(placed(op), steps[op])] += piece_seconds(op, measured) if measured else \
                piece_flops(op) / flops_per_s
    if step_cost is not None:
        cost = defaultdict(float, {key: step_cost(*key) for key in cost})
    wire: dict[tuple[Key, Key], int] = {}  # (sender step, reader step) -> bytes it reads
    sources = Sources(ops)
    for op in ops:  # the data edges between the pieces, as between steps
        b = steps.get(op)
        for v in op.inputs:
            for p, held in sources.find(v, op.device):
                a = steps.get(p)
                if a is None or b is None or a == b:
                    continue
                edge = ((placed(p), a), (placed(op), b))
                common = held.intersect(v.mask)
                far = bytes_per_s and p.device != op.device and common is not None
                wire[edge] = wire.get(edge, 0) + (
                    common.numel * v.ptensor.dtype.itemsize if far and common else 0)
    if plan.micro > 1:  # a template's micro-batch 0 stands for every micro-batch
        cost = defaultdict(float, {(d, _micro(step, m)): c for (d, step), c in cost.items()
                                   for m in range(plan.micro)})
        wire = {((a, _micro(x, m)), (b, _micro(y, m))): n for ((a, x), (b, y)), n in wire.items()
                for m in range(plan.micro)}
    return StepTimes(order, cost, wire)


def _micro(step: str, m: int) -> str:
    """A template's step of micro-batch 0 (``"1F0"``) as micro-batch ``m``'s."""
    return f"{step[:-1]}{m}"


@dataclass(frozen=True)
class _Run:
    """A rank runs one step (a local instruction to the replay engine)."""

    step: str


class _StepCosts(Costs):
    def __init__(self, cost: dict[Key, float], bytes_per_s: float | None) -> None:
        self.cost, self.bytes_per_s = cost, bytes_per_s

    def local(self, rank: int, ins, since: float) -> float:
        return self.cost[(rank, ins.step)]

    def message(self, src: int, dst: int, nbytes: float, ready: float, since: float,
                ) -> tuple[float, float]:
        took = nbytes / self.bytes_per_s if self.bytes_per_s else 0.0
        return ready + took, took


def _replayed(times: StepTimes, bytes_per_s: float | None) -> list[Bar]:
    """Each rank posts the receives of all its steps, then runs its steps in order, each
    after the messages it reads arrived, and sends what it made to the steps reading it."""
    order, cost, wire = times.order, times.cost, times.wire
    tag = {edge: i for i, edge in enumerate(wire)}
    code: dict[int, list] = {r: [] for r in range(max(order) + 1)}
    for (src, dst), nbytes in wire.items():
        code[dst[0]].append(Recv(f"m{tag[(src, dst)]}", (nbytes,), torch.uint8, src[0],
                                 tag[(src, dst)], handle=f"h{tag[(src, dst)]}"))
    into: dict[Key, list[tuple[Key, Key]]] = defaultdict(list)
    out: dict[Key, list[tuple[Key, Key]]] = defaultdict(list)
    for edge in wire:
        out[edge[0]].append(edge)
        into[edge[1]].append(edge)
    for r, steps in order.items():
        for step in steps:
            code[r] += [Wait(f"h{tag[e]}", ()) for e in into[(r, step)]]
            code[r].append(_Run(step))
            code[r] += [Send("", (), e[1][0], tag[e]) for e in out[(r, step)]]
    played = replay([code[r] for r in sorted(code)], _StepCosts(cost, bytes_per_s), spans=True)
    ended: dict[Key, float] = {}
    bars = []
    for r, run, start, end in played.spans:
        assert isinstance(run, _Run)
        ended[(r, run.step)] = end
        bars.append(Bar(r, run.step, start, end))
    if played.stuck:
        stuck = {r: next(s for s in order[r] if (r, s) not in ended) for r in played.stuck}
        raise PlanError(f"the pipeline order waits on itself at {stuck}")
    for (src, dst), nbytes in wire.items():  # bytes on the link after their step ended
        if nbytes and bytes_per_s:
            bars.append(Bar(dst[0], dst[1], ended[src], ended[src] + nbytes / bytes_per_s,
                            message=True))
    return bars
