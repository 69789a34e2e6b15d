"""Automatic plan search: a plan found by a solver goes through the same check, compile and
runtime as one written by hand.

``search(graph, devices, cluster=..., memory=...)`` cuts every op over the devices as the
intra-op ILP (``search/ilp.py``) finds cheapest under the cluster's cost model, within the
per-device memory limit, builds the plan with the primitives, and reports the
simulator's step time next to the ready-made data- and tensor-parallel plans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from chronotope.cost.network import Cluster, cluster_for
from chronotope.errors import ChronotopeError, PlanError
from chronotope.graph.ir import Graph
from chronotope.plan.check import format_bytes
from chronotope.plan.plan import Plan
from chronotope.search.ilp import NoFit, Solution, solve
from chronotope.search.space import nbytes, repeated, strategies

METHODS = ("auto", "ilp")
ROUNDS = 6  # solves at most, tightening the budget to the plan's own memory estimate


class SearchError(ChronotopeError):
    """No plan fits, or the search cannot run as asked."""


@dataclass
class SearchResult:
    plan: Plan
    method: str
    predicted_step_s: float  # the simulator's step time of the plan
    peak_memory_bytes: list[int]  # per device, the plan's estimate
    search_s: float
    variables: int  # of the ILP
    # what was explored: the plan found and the ready-made ones, each simulated
    candidates: list[dict[str, Any]] = field(default_factory=list)
    choices: dict[str, str] = field(default_factory=dict)  # op -> strategy, for reading


def search(graph: Graph, devices: int, cluster: Cluster | str | None = None,
           memory: float | None = None, method: str = "auto",
           time_limit: float = 60.0) -> SearchResult:
    """The cheapest plan of ``graph`` over ``devices`` that fits ``memory`` bytes per
    device (by the plan's own estimate)."""
    if method not in METHODS:
        raise SearchError(f"unknown search method {method!r}: use {', '.join(METHODS)}")
    if devices < 1:
        raise SearchError(f"search needs at least one device, got {devices}")
    if not isinstance(cluster, Cluster):
        cluster = cluster_for(devices, cluster)
    start = time.perf_counter()
    space = strategies(graph, devices, cluster)
    groups = repeated(graph, space)
    budget, peaks = memory, []
    for _ in range(ROUNDS):
        try:
            solution = solve(graph, space, devices, cluster, budget, time_limit=time_limit,
                             groups=groups)
        except NoFit as e:
            if peaks:  # only after tightening: the plans the solver's model lets fit do not
                raise SearchError(_too_big(memory, max(peaks))) from None
            raise SearchError(_no_fit(graph, space, devices, memory, e.least)) from None
        plan = build(graph, devices, solution)
        checked = plan.check()
        peaks = [checked.memory[d].total for d in range(devices)]
        if memory is None or max(peaks) <= memory:
            break
        # The solver's memory model counts activations coarsely; the plan's estimate
        # (by liveness) rules: ask again with the excess taken off the budget.
        assert budget is not None
        budget -= (max(peaks) - memory) + 0.01 * memory
    else:
        raise SearchError(_too_big(memory, max(peaks)))
    seconds = time.perf_counter() - start
    candidates = [_simulated("searched", plan, cluster)]
    candidates += [c for c in (_ready_made(graph, devices, name, cluster)
                               for name in ("dp", "tp")) if c is not None]
    return SearchResult(plan, "ilp", candidates[0]["predicted_step_s"], peaks, seconds,
                        solution.variables, candidates,
                        {op.name: s.label for op, s in solution.choice.items()})


def build(graph: Graph, devices: int, solution: Solution) -> Plan:
    """The plan the choices make: each op cut as chosen, piece ``i`` on device ``i``."""
    plan = Plan(graph, devices)
    for op in graph.ops:
        strategy = solution.choice.get(op)
        if devices == 1 or strategy is None:
            plan.assign(op.name, 0)
            continue
        for device, piece in enumerate(plan.trans(op.name, strategy.algo)):
            plan.assign(piece, device)
    return plan


def _simulated(name: str, plan: Plan, cluster: Cluster) -> dict[str, Any]:
    from chronotope.compile import compile as compile_plan
    from chronotope.cost.simulate import simulate

    sim = simulate(compile_plan(plan, cluster=cluster), cluster)
    checked = plan.check()
    return {"plan": name, "predicted_step_s": sim.step_time,
            "peak_memory_bytes": max(checked.memory[d].total for d in range(plan.ndevices))}


def _ready_made(graph: Graph, devices: int, name: str, cluster: Cluster
                ) -> dict[str, Any] | None:
    from chronotope.policies import mesh

    try:
        plan = mesh(graph, dp=devices) if name == "dp" else mesh(graph, tp=devices)
        return _simulated(name, plan, cluster)
    except PlanError:
        return None


def _too_big(memory: float | None, peak: float) -> str:
    return (f"no plan found fits {format_bytes(memory or 0)} per device by the plan's own "
            f"memory estimate: the smallest found needs {format_bytes(peak)}; give more "
            "memory or devices")


def _no_fit(graph: Graph, space, devices: int, memory: float | None, least: float) -> str:
    """Which term binds: the parameters' weights, gradients and optimizer state at their
    best cut, the rest activations; and the parameter that needs the most."""
    states, worst, worst_bytes = 0.0, None, 0.0
    for t in graph.params.values():
        readers = [op for op in graph.ops if t in op.inputs and space.get(op)]
        cut = any(s.inputs[op.inputs.index(t)][0] == "S" for op in readers for s in space[op])
        held = 4 * nbytes(t) / (devices if cut else 1)
        states += held
        if held > worst_bytes:
            worst, worst_bytes = t, held
    largest = f" (the most: {worst.name}, {format_bytes(worst_bytes)})" if worst else ""
    return (f"no plan over {devices} devices fits {format_bytes(memory or 0)} per device: the "
            f"least any needs is about {format_bytes(least)}: weights, gradients and optimizer "
            f"state {format_bytes(states)} at their best cut{largest}, activations the rest; "
            "give more memory or devices")


__all__ = ["METHODS", "SearchError", "SearchResult", "build", "search"]
