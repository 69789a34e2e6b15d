"""Temporal-order search: when each pipeline rank runs each of its steps, found by a solver.

The pipeline keeps a built-in family's shape (``policies/pipeline.py``: the stages each
rank holds, how many pipelines run, which passes recycle); the search chooses each
rank's order of its steps (``Step``: a stage's F, B or W for one micro-batch). The steps,
their times and the bytes between them are the plan's own, as ``compile.timeline``
prices them: FLOPs at a device speed, measured op times, or given step costs. The order
is a CP-SAT model (OR-Tools):

- an interval per step, as long as the step takes (in ticks: the longest step is
  ``RESOLUTION`` of them);
- a step starts once the steps it reads from have ended and their bytes crossed the link;
- a rank's steps do not overlap, and one stage runs its F (B, W) steps in micro-batch
  order (micro-batches are alike: any other order is one of these relabelled);
- a micro-batch's activations, from its forward's start to the end of its last backward
  step, count against the rank's bound (``limit``: how many it keeps at once; by default
  what the family's own order keeps, so memory does not grow);
- the last step's end is minimised.

The family's own order, replayed, is the solver's hint and horizon: it starts there and
never returns worse. The order found runs on the plan rebuilt with it (``Order``), which
``check`` checks like any other, and its timeline is what is reported.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from chronotope.compile.timeline import StepTimes, step_times, timeline
from chronotope.cost.times import OpTime
from chronotope.errors import PlanError
from chronotope.graph.ir import Graph
from chronotope.plan.plan import Plan
from chronotope.plan.steps import Kind, Step, held_at_most
from chronotope.policies.config import ParallelConfig, make
from chronotope.policies.pipeline import SCHEDULES, Order

RESOLUTION = 1000  # ticks in the longest step: the order's times are exact to 0.1% of it


@dataclass
class StepGraph:
    """A pipeline's steps: which rank runs each, for how long, what each waits for (and
    the seconds its bytes take after that step ends), and each rank's given order."""

    rank_of: dict[Step, int]
    seconds: dict[Step, float]
    after: dict[Step, dict[Step, float]]
    orders: dict[int, list[Step]]

    @staticmethod
    def of(times: StepTimes, bytes_per_s: float | None = None) -> StepGraph:
        """The steps of a plan's timeline (``compile.timeline.step_times``). Devices that
        run the same stages (tensor-parallel peers, data-parallel replicas) are one
        pipeline rank, which runs each step as long as its slowest device; ranks are
        numbered by their first stage, as every family numbers them."""
        held = {d: frozenset(s.stage for s in map(_step, steps))
                for d, steps in times.order.items()}
        ranks = sorted(set(held.values()), key=min)
        orders = {r: [_step(a) for a in times.order[min(d for d in held if held[d] == stages)]]
                  for r, stages in enumerate(ranks)}
        seconds: dict[Step, float] = defaultdict(float)
        for (_, action), cost in times.cost.items():
            step = _step(action)
            seconds[step] = max(seconds[step], cost)
        after: dict[Step, dict[Step, float]] = defaultdict(dict)
        for ((_, a), (_, b)), nbytes in times.wire.items():
            x, y = _step(a), _step(b)
            if x != y:
                took = nbytes / bytes_per_s if bytes_per_s and nbytes else 0.0
                after[y][x] = max(after[y].get(x, 0.0), took)
        for y in seconds:  # a backward reads what its forward kept; W what its B made
            x = Step(Kind.F if y.kind is Kind.B else Kind.B, y.stage, y.micro)
            if y.kind is not Kind.F and x in seconds:
                after[y].setdefault(x, 0.0)
        return StepGraph({s: r for r, steps in orders.items() for s in steps},
                         {s: seconds[s] for r in orders for s in orders[r]}, dict(after),
                         orders)

    def releases(self) -> dict[Step, Step]:
        """Each forward that keeps activations, and the step after which they go: the
        weight-gradient step where the backward is split, else the backward."""
        out = {}
        for s in self.rank_of:
            if s.kind is Kind.F:
                back = next((t for t in (Step(Kind.W, s.stage, s.micro),
                                         Step(Kind.B, s.stage, s.micro)) if t in self.rank_of),
                            None)
                if back is not None:
                    out[s] = back
        return out

    def kept(self, orders: Mapping[int, Sequence[Step]]) -> dict[int, int]:
        """Per rank, the most micro-batches' activations it keeps at once in ``orders``
        (those of stages with a backward, as ``plan.steps.held_at_most`` counts them)."""
        kept = {f.stage: 1 for f in self.releases()}
        return {r: int(held_at_most(steps, kept)) for r, steps in orders.items()}

    def play(self, orders: Mapping[int, Sequence[Step]],
             seconds: Mapping[Step, float] | None = None,
             after: Mapping[Step, Mapping[Step, float]] | None = None) -> dict[Step, float]:
        """Each step's start when every rank runs its steps in ``orders``, each as soon as
        its rank is free and what it reads has arrived; a PlanError names where the
        orders wait on each other."""
        seconds = self.seconds if seconds is None else seconds
        after = self.after if after is None else after
        start: dict[Step, float] = {}
        end: dict[Step, float] = {}
        at = dict.fromkeys(orders, 0)
        free = dict.fromkeys(orders, 0.0)
        moved = True
        while moved:
            moved = False
            for r, steps in orders.items():
                while at[r] < len(steps):
                    s = steps[at[r]]
                    waits = after.get(s, {})
                    if any(p not in end for p in waits):
                        break
                    start[s] = max([free[r], *(end[p] + t for p, t in waits.items())])
                    end[s] = free[r] = start[s] + seconds[s]
                    at[r] += 1
                    moved = True
        stuck = {r: steps[at[r]] for r, steps in orders.items() if at[r] < len(steps)}
        if stuck:
            raise PlanError("the order waits on itself: " + ", ".join(
                f"rank {r} at {s.action()}" for r, s in sorted(stuck.items())))
        return start

    def makespan(self, orders: Mapping[int, Sequence[Step]]) -> float:
        start = self.play(orders)
        return max((start[s] + self.seconds[s] for s in start), default=0.0)


@dataclass
class Solved:
    """A searched order: each rank's steps, the solver's verdict (optimal, feasible, or
    the given order kept), its makespan and the solver's lower bound on it (seconds, in
    the step graph's own times), and how long the solve took."""

    orders: dict[int, list[Step]]
    status: str
    makespan: float
    bound: float
    seconds: float


def solve(graph: StepGraph, limit: Mapping[int, int] | None = None,
          seconds: float = 10.0, workers: int = 0) -> Solved:
    """The order of each rank's steps with the least makespan whose activations stay
    within ``limit`` per rank (default: what the given orders keep), within ``seconds``
    of solving (``workers``: CP-SAT's threads, 0 for every core)."""
    from ortools.sat.python import cp_model

    began = time.perf_counter()
    given = graph.kept(graph.orders)
    limit = dict(given if limit is None else limit)
    tick = max(graph.seconds.values(), default=0.0) / RESOLUTION or 1.0
    ticks = {s: max(1, round(t / tick)) for s, t in graph.seconds.items()}
    waits = {s: {p: round(t / tick) for p, t in before.items()}
             for s, before in graph.after.items()}
    hint = graph.play(graph.orders, ticks, waits)
    if all(given[r] <= limit.get(r, given[r]) for r in given):
        horizon = int(max(hint[s] + ticks[s] for s in hint))
    else:  # the given order keeps more than allowed: no help, and no bound
        hint = {}
        horizon = sum(ticks.values()) + sum(t for before in waits.values()
                                            for t in before.values())
    runs: dict[tuple[Kind, int], list[Step]] = defaultdict(list)
    for s in sorted(ticks, key=lambda s: s.micro):
        runs[(s.kind, s.stage)].append(s)
    before = {s: dict(waits.get(s, {})) for s in ticks}
    for same in runs.values():
        for a, b in zip(same, same[1:]):
            before[b].setdefault(a, 0)
    head, tail = _paths(before, ticks)
    model = cp_model.CpModel()
    start = {s: model.new_int_var(head[s], max(head[s], horizon - ticks[s] - tail[s]),
                                  s.action()) for s in ticks}
    span = {s: model.new_fixed_size_interval_var(start[s], ticks[s], "") for s in ticks}
    for s, waited in before.items():
        for p, t in waited.items():
            model.add(start[s] >= start[p] + ticks[p] + t)
    kept: dict[int, list] = defaultdict(list)
    for f, back in graph.releases().items():
        size = model.new_int_var(0, horizon, "")
        kept[graph.rank_of[f]].append(model.new_interval_var(
            start[f], size, start[back] + ticks[back], ""))
    for r, steps in graph.orders.items():
        model.add_no_overlap([span[s] for s in steps])
        if kept[r]:
            model.add_cumulative(kept[r], [1] * len(kept[r]), limit.get(r, len(kept[r])))
    last = model.new_int_var(0, horizon, "makespan")
    model.add_max_equality(last, [start[s] + ticks[s] for s in ticks])
    model.minimize(last)
    for s, at in hint.items():
        model.add_hint(start[s], int(at))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = workers
    status = solver.solve(model)
    took = time.perf_counter() - began
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if not hint:
            raise PlanError(_refused(graph, limit, status == cp_model.INFEASIBLE, seconds))
        return Solved(graph.orders, "given", graph.makespan(graph.orders), 0.0, took)
    orders = {r: sorted(steps, key=lambda s: solver.value(start[s]))
              for r, steps in graph.orders.items()}
    # no order is shorter in ticks than the solver's bound, nor in seconds than that
    # bound times the least ratio of a step's (or message's) seconds to its ticks
    ratio = min([graph.seconds[s] / (ticks[s] * tick) for s in ticks if graph.seconds[s]]
                + [graph.after[s][p] / (t * tick) for s, before in waits.items()
                   for p, t in before.items() if t and graph.after[s][p]], default=1.0)
    bound = solver.best_objective_bound * tick * ratio
    found = graph.makespan(orders)
    own = graph.makespan(graph.orders) if hint else math.inf
    if own < found:  # (ticks round the times)
        return Solved(graph.orders, "given", own, bound, took)
    return Solved(orders, "optimal" if status == cp_model.OPTIMAL else "feasible", found,
                  min(bound, found), took)


def _paths(before: dict[Step, dict[Step, int]], ticks: Mapping[Step, int]
           ) -> tuple[dict[Step, int], dict[Step, int]]:
    """Each step's earliest start (the longest chain of waits before it) and the least
    time after its end (the longest chain after it): the bounds of its start."""
    order: list[Step] = []
    seen: set[Step] = set()
    for root in before:
        todo = [(root, False)]
        while todo:
            s, done = todo.pop()
            if done:
                order.append(s)
            elif s not in seen:
                seen.add(s)
                todo.append((s, True))
                todo += [(p, False) for p in before[s] if p not in seen]
    head = {s: 0 for s in before}
    for s in order:  # every step after the steps it waits for
        head[s] = max([0, *(head[p] + ticks[p] + t for p, t in before[s].items())])
    tail = {s: 0 for s in before}
    for s in reversed(order):
        for p, t in before[s].items():
            tail[p] = max(tail[p], t + ticks[s] + tail[s])
    return head, tail


def _refused(graph: StepGraph, limit: Mapping[int, int], infeasible: bool,
             seconds: float) -> str:
    releases = graph.releases()
    least = {r: 1 for r, steps in graph.orders.items() if any(s in releases for s in steps)}
    low = [f"rank {r} ({limit[r]})" for r in sorted(limit) if limit[r] < least.get(r, 0)]
    if infeasible and low:
        return (f"no order keeps the activations within the limit on {', '.join(low)}: "
                "every rank with a backward keeps at least one micro-batch; raise the limit")
    if infeasible:
        return ("no order of these steps keeps within the limit "
                f"{dict(sorted(limit.items()))} per rank; raise it")
    return (f"the solver found no order within {seconds:g} s; give it more time "
            "(seconds=...) or a looser limit")


@dataclass
class OrderResult:
    """An order search's outcome: the plan in the order found, and the family's own order
    beside it, both timed on the plan's timeline."""

    plan: Plan
    order: Order
    solved: Solved
    makespan: float  # seconds, on the rebuilt plan's timeline
    bubble: float
    given_makespan: float  # the family's own order
    given_bubble: float
    kept: dict[int, int]  # per pipeline rank, micro-batches' activations at once
    given_kept: dict[int, int]
    limit: dict[int, int]

    @property
    def speedup(self) -> float:
        return self.given_makespan / self.makespan if self.makespan else 1.0


def search_order(graph: Graph, config: ParallelConfig, *,
                 limit: int | Sequence[int] | Mapping[int, int] | None = None,
                 seconds: float = 10.0, flops_per_s: float = 1e12,
                 step_cost: Callable[[int, str], float] | None = None,
                 measured: dict[str, OpTime] | None = None,
                 bytes_per_s: float | None = None, workers: int = 0) -> OrderResult:
    """Search the order of the pipeline ``config`` names (a family: ``1f1b``, ``zb1``,
    ``zbv``, ``interleaved``, ``chimera``, ``3f1b``, ...) on ``graph``, timed as
    ``compile.timeline`` times it (``flops_per_s``, ``step_cost``, ``measured``,
    ``bytes_per_s``). ``limit``: the most micro-batches' activations each pipeline rank
    keeps at once (one number for all, one per rank; default the family's own order's).
    Returns the plan in the order found, which ``dataclasses.replace(config,
    schedule=result.order)`` (or ``--schedule`` with its CSV, ``result.order.write``)
    builds again."""
    if config.policy not in SCHEDULES:
        raise PlanError(f"the order search orders a pipeline: give one of "
                        f"{', '.join(SCHEDULES)} as the policy, not {config.policy!r}")
    given = make(graph, config)
    steps = StepGraph.of(step_times(given, flops_per_s, step_cost, measured, bytes_per_s),
                         bytes_per_s)
    own = steps.kept(steps.orders)
    if limit is None:
        bound = own
    elif isinstance(limit, int):
        bound = dict.fromkeys(own, limit)
    elif isinstance(limit, Mapping):
        bound = {r: limit[r] for r in own}
    else:
        if len(limit) != len(own):
            raise PlanError(f"limit names {len(limit)} ranks; the pipeline has {len(own)}")
        bound = dict(zip(sorted(own), limit))
    solved = solve(steps, bound, seconds, workers)
    order = Order(config.policy, solved.orders)
    plan = make(graph, replace(config, schedule=order))
    found, before = (timeline(p, flops_per_s, step_cost, measured, bytes_per_s)
                     for p in (plan, given))
    return OrderResult(plan, order, solved, found.makespan, found.bubble_ratio,
                       before.makespan, before.bubble_ratio, steps.kept(solved.orders), own,
                       bound)


def _step(action: str) -> Step:
    step = Step.parse(action)
    if step is None:
        raise PlanError(f"pipeline step {action!r} is not a stage's F, B, I or W")
    return step

