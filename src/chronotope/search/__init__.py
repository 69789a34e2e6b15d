"""Automatic plan search: a plan found by a solver goes through the same check, compile and
runtime as one written by hand.

``search(graph, devices, cluster=..., memory=...)`` cuts every op over the devices as the
intra-op ILP (``search/ilp.py``) finds cheapest under the cluster's cost model, within the
per-device memory limit, builds the plan with the primitives, and reports the
simulator's step time next to the ready-made data- and tensor-parallel plans.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chronotope.cost.network import Cluster, cluster_for
from chronotope.errors import ChronotopeError, PlanError
from chronotope.graph.ir import Graph, TensorKind
from chronotope.plan.check import format_bytes
from chronotope.plan.plan import Plan
from chronotope.search.build import build
from chronotope.search.ilp import NoFit, Solution, solve
from chronotope.search.space import WHOLE, Mesh, meshes, nbytes, repeated, strategies

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
    mesh: str = ""  # the device mesh of the plan found, e.g. "2x4"
    explored: list[dict[str, Any]] = field(default_factory=list)  # each mesh's optimum


def search(graph: Graph, devices: int, cluster: Cluster | str | None = None,
           memory: float | None = None, method: str = "auto",
           time_limit: float = 60.0, mesh: Sequence[int] | None = None) -> SearchResult:
    """The cheapest plan of ``graph`` over ``devices`` that fits ``memory`` bytes per
    device (by the plan's own estimate), over every mesh ``devices`` factors into, or
    over ``mesh`` alone (``(2, 4)``: two groups of four)."""
    if method not in METHODS:
        raise SearchError(f"unknown search method {method!r}: use {', '.join(METHODS)}")
    if devices < 1:
        raise SearchError(f"search needs at least one device, got {devices}")
    if mesh is not None and math.prod(mesh) != devices:
        raise SearchError(f"mesh {'x'.join(map(str, mesh))} has {math.prod(mesh)} devices, "
                          f"not {devices}")
    if not isinstance(cluster, Cluster):
        cluster = cluster_for(devices, cluster)
    start = time.perf_counter()
    solved, explored, least = [], [], None
    for shape in meshes(devices) if mesh is None else [Mesh(tuple(mesh))]:
        space = strategies(graph, shape, cluster)
        groups = repeated(graph, space)
        try:
            solution = solve(graph, space, shape, cluster, memory, time_limit=time_limit,
                             groups=groups)
        except NoFit as e:
            least = e.least if least is None else min(least, e.least)
            explored.append({"mesh": str(shape), "model_step_s": None})
            continue
        solved.append((solution, space, groups))
        explored.append({"mesh": str(shape), "model_step_s": solution.seconds,
                         "variables": solution.variables})
    if not solved:
        space = strategies(graph, devices, cluster)
        raise SearchError(_no_fit(graph, space, devices, memory, least or 0.0))
    solved.sort(key=lambda found: found[0].seconds)
    peak = None
    for solution, space, groups in solved:
        try:
            solution, plan, peaks = _fitted(graph, solution, space, groups, cluster, memory,
                                            time_limit)
            break
        except _TooBig as e:
            peak = e.peak if peak is None else min(peak, e.peak)
    else:
        raise SearchError(_too_big(memory, peak or 0.0))
    seconds = time.perf_counter() - start
    candidates = [{**_simulated("searched", plan, cluster), "mesh": str(solution.mesh)}]
    candidates += [c for c in (_ready_made(graph, devices, name, cluster)
                               for name in ("dp", "tp")) if c is not None]
    for c in candidates:
        c["fits"] = memory is None or c["peak_memory_bytes"] <= memory
    return SearchResult(plan, "ilp", candidates[0]["predicted_step_s"], peaks, seconds,
                        sum(e.get("variables", 0) for e in explored), candidates,
                        {op.name: s.label for op, s in solution.choice.items()},
                        str(solution.mesh), explored)


class _TooBig(Exception):
    def __init__(self, peak: float) -> None:
        super().__init__(peak)
        self.peak = peak


def _fitted(graph: Graph, solution: Solution, space, groups, cluster: Cluster,
            memory: float | None, time_limit: float) -> tuple[Solution, Plan, list[int]]:
    """The solution's plan, solved again with a tighter budget until the plan's own memory
    estimate fits: the solver counts activations coarsely, the estimate by liveness."""
    budget = memory
    for _ in range(ROUNDS):
        plan = build_solution(graph, solution)
        checked = plan.check()
        peaks = [checked.memory[d].total for d in range(plan.ndevices)]
        if memory is None or max(peaks) <= memory:
            return solution, plan, peaks
        assert budget is not None
        budget -= (max(peaks) - memory) + 0.01 * memory
        try:
            solution = solve(graph, space, solution.mesh, cluster, budget,
                             time_limit=time_limit, groups=groups)
        except NoFit:
            raise _TooBig(max(peaks)) from None
    raise _TooBig(max(peaks))


def build_solution(graph: Graph, solution: Solution) -> Plan:
    """The plan the choices make: each op cut as chosen over the solution's mesh; the
    weights whose first reader chose ZeRO have their updates cut over the devices."""
    zero, seen = [], set()
    for op in graph.ops:
        s = solution.choice.get(op)
        for i, t in enumerate(op.inputs):
            if t.kind is TensorKind.PARAM and t not in seen:
                seen.add(t)
                if s is not None and s.zero and not t.frozen and \
                        all(lay == WHOLE for lay in s.inputs[i]):
                    zero.append(_param_name(graph, t))
    return build(graph, solution.mesh.shape,
                 {op: s.algos for op, s in solution.choice.items()}, zero)


def _param_name(graph: Graph, t) -> str:
    return next(name for name, p in graph.params.items() if p is t)


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
        cut = any(lay.startswith("S") for op in readers for s in space[op]
                  for lay in s.inputs[op.inputs.index(t)])
        held = 4 * nbytes(t) / (devices if cut else 1)
        states += held
        if held > worst_bytes:
            worst, worst_bytes = t, held
    largest = f" (the most: {worst.name}, {format_bytes(worst_bytes)})" if worst else ""
    return (f"no plan over {devices} devices fits {format_bytes(memory or 0)} per device: the "
            f"least any needs is about {format_bytes(least)}: weights, gradients and optimizer "
            f"state {format_bytes(states)} at their best cut{largest}, activations the rest; "
            "give more memory or devices")


__all__ = ["METHODS", "SearchError", "SearchResult", "build", "build_solution", "search"]
