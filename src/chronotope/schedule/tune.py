"""``ct.tune``: a schedule's knobs chosen by the simulator's step time, within memory.

The space is what the schedule function's ``sch.knob`` calls span, ranges that depend
on earlier knobs included: it is found by running the function (no plan is made), once
per point, forcing a prefix of the choices and taking the first of the rest. Every
point is then priced by lowering, compiling and simulating its plan on the cluster;
points the schedule refuses, or that need more memory than the devices have, are kept
with the reason and never chosen. Small spaces are priced whole; large ones by
randomised coordinate descent (one knob at a time, the others held, from random
starts), which prices a fraction of them. ``measure`` runs the best points for real.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chronotope.compile import Program, compile
from chronotope.compile.simulate import simulate
from chronotope.cost.network import Cluster, cluster_for
from chronotope.errors import ChronotopeError, ScheduleError
from chronotope.graph.capture import capture
from chronotope.graph.ir import Graph
from chronotope.schedule.schedule import Schedule, apply, schedule
from chronotope.workload import Workload

EXHAUSTIVE_UP_TO = 32  # points; larger spaces are searched by coordinate descent

Knobs = dict[str, Any]


@dataclass
class Point:
    """One point of the space: its knobs, and what the simulator (and a real run) said."""

    knobs: Knobs
    step_time: float | None = None  # predicted seconds; None: not priced or refused
    memory: int | None = None  # the largest predicted peak over the devices, bytes
    refused: str = ""  # why the point cannot run (the schedule's error, or memory)
    measured: float | None = None  # seconds per step on local processes (``measure``)

    @property
    def fits(self) -> bool:
        return self.step_time is not None and not self.refused


@dataclass
class Tuning:
    """What ``tune`` priced: every point, in the order priced, and the best of them."""

    points: list[Point]
    space: int  # points in the space
    method: str  # "exhaustive" or "coordinate descent"
    cluster: str

    @property
    def best(self) -> Point:
        fitting = [p for p in self.points if p.fits]
        if not fitting:
            reasons = {p.refused for p in self.points if p.refused}
            raise ScheduleError(f"no point of the {self.space} tried can run: "
                                + "; ".join(sorted(reasons)[:3]))
        return min(fitting, key=lambda p: p.step_time)

    def ranked(self) -> list[Point]:
        """The points that fit, fastest first, then the rest."""
        return sorted(self.points, key=lambda p: (not p.fits, p.step_time or 0.0))


def space(fn: Callable[[Schedule], Any], workload: Workload, devices: int,
          graph: Graph) -> list[Knobs]:
    """Every point the schedule's knobs span, in depth-first order of its knob calls."""
    points, stack = [], [{}]
    while stack:
        forced = stack.pop()
        calls = _knob_calls(fn, workload, devices, graph, forced)
        points.append({name: value for name, _, value in calls})
        for i in reversed(range(len(calls))):
            name, choices, value = calls[i]
            if name in forced:
                continue
            before = {n: v for n, _, v in calls[:i]}
            stack.extend({**before, name: c} for c in reversed(choices) if c != value)
    return points


def _knob_calls(fn, workload, devices, graph, forced) -> list[tuple[str, list[Any], Any]]:
    sch = schedule(workload, devices=devices, graph=graph, knobs=forced)
    try:
        apply(fn, sch)
    except ChronotopeError:
        pass  # a point the schedule refuses still has the knobs it asked for before
    return list(sch._state.knob_calls)


def tune(fn: Callable[[Schedule], Any], model: Workload, devices: int,
         cluster: Cluster | str | None = None, memory: float | None = None, *,
         method: str = "auto", seed: int = 0, restarts: int = 2, measure: int = 0,
         steps: int = 3, graph: Graph | None = None,
         progress: Callable[[Point], None] | None = None) -> Tuning:
    """The knobs of ``fn(sch)`` that give ``model`` the shortest predicted step on
    ``devices`` devices of ``cluster`` (a preset name, or default DGX A100 nodes), each
    device holding at most ``memory`` bytes. ``method``: "exhaustive", "descent" or
    "auto" (exhaustive up to ``EXHAUSTIVE_UP_TO`` points). ``measure`` = k also trains the
    k best points for ``steps`` steps on local processes and records their step time."""
    graph = graph or capture(model)
    machines = cluster if isinstance(cluster, Cluster) else cluster_for(devices, cluster)
    points = space(fn, model, devices, graph)
    if method == "auto":
        method = "exhaustive" if len(points) <= EXHAUSTIVE_UP_TO else "descent"
    if method not in ("exhaustive", "descent"):
        raise ScheduleError(f"tune(method={method!r}): exhaustive, descent or auto")
    priced: dict[tuple, Point] = {}

    def price(knobs: Knobs) -> Point:
        key = tuple(sorted(knobs.items()))
        if key not in priced:
            priced[key] = _price(fn, model, devices, graph, knobs, machines, memory)
            if progress:
                progress(priced[key])
        return priced[key]

    if method == "exhaustive":
        for knobs in points:
            price(knobs)
    else:
        _descend(points, price, priced, random.Random(seed), restarts)
    tuning = Tuning(list(priced.values()), len(points),
                    "exhaustive" if method == "exhaustive" else "coordinate descent",
                    machines.name)
    if measure:
        _measure([p for p in tuning.ranked() if p.fits][:measure], fn, model, devices, graph,
                 steps)
    return tuning


def _program(fn, model, devices, graph, knobs) -> tuple[Program, Workload]:
    """The compiled plan of the schedule at one point, and the workload it trains."""
    sch = apply(fn, schedule(model, devices=devices, graph=graph, knobs=knobs))
    return compile(sch.plan()), sch.workload


def _price(fn, model, devices, graph, knobs, cluster, memory) -> Point:
    point = Point(dict(knobs))
    try:
        sim = simulate(_program(fn, model, devices, graph, knobs)[0], cluster)
    except ChronotopeError as e:
        point.refused = str(e)
        return point
    point.step_time = sim.step_time
    point.memory = max(r.peak_memory for r in sim.ranks)
    if memory is not None and point.memory > memory:
        point.refused = f"needs {point.memory / 2**30:.2f} GiB on a device, more than " \
                        f"{memory / 2**30:.2f} GiB"
    return point


def _descend(points: list[Knobs], price: Callable[[Knobs], Point], priced: dict[tuple, Point],
             rng: random.Random, restarts: int) -> None:
    """Randomised coordinate descent: from a random start, try each other value of one knob
    (knobs in random order) with the rest held, and move to the fastest point found, until
    no knob improves; again from ``restarts`` more random starts not priced yet. Where a
    value changes the range of a knob after it (more stages need more micro-batches), the
    points that keep the most of the other knobs are tried."""
    def time(knobs: Knobs) -> float:
        p = price(knobs)
        return p.step_time if p.fits else float("inf")

    def kept(k: Knobs, current: Knobs) -> int:
        return sum(k.get(n) == v for n, v in current.items())

    for _ in range(restarts + 1):
        fresh = [k for k in points if tuple(sorted(k.items())) not in priced]
        if not fresh:
            return
        current = rng.choice(fresh)
        improved = True
        while improved:
            improved = False
            for name in rng.sample(sorted(current), len(current)):
                line = []
                for value in {k[name] for k in points if name in k} - {current[name]}:
                    same = [k for k in points if k.get(name) == value]
                    most = max(kept(k, current) for k in same)
                    line += [k for k in same if kept(k, current) == most]
                best = min(line, key=time, default=None)
                if best is not None and time(best) < time(current):
                    current, improved = best, True


def _measure(best: list[Point], fn, model, devices, graph, steps) -> None:
    from chronotope.runtime.launch import run_processes
    from chronotope.runtime.optim import Optim
    from chronotope.runtime.train import mean_step_time

    for point in best:
        program, workload = _program(fn, model, devices, graph, point.knobs)
        result = run_processes(program, workload, steps, Optim())
        point.measured = mean_step_time(result)
