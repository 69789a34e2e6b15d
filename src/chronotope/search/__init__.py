"""Automatic plan search: a plan found by a solver goes through the same check, compile and
runtime as one written by hand.

``search(graph, devices, cluster=..., memory=...)`` prices three families under the
cluster's cost model, in the dtype the step computes in, and keeps the cheapest that fits
``memory`` per device (the cluster's device memory unless given) by the plan's own
estimate: the mesh policy's knobs (``search/knobs.py``: data, tensor and pipeline degrees,
micro-batches, interleaving, recompute, sequence parallelism: what experts run at
scale), every op cut over all devices as the intra-op ILP (``search/ilp.py``) finds best
on each device mesh, and pipelines whose stages the stage DP (``search/stages.py``) cuts,
each stage cut by the ILP on its own devices. The plan is built with the primitives,
simulated, and reported next to the ready-made data- and tensor-parallel plans.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chronotope.compile.rvd import is_shard
from chronotope.cost.compute import Traffic, op_flops
from chronotope.cost.network import Cluster, cluster_for
from chronotope.errors import ChronotopeError, PlanError
from chronotope.graph.autocast import DTYPES
from chronotope.graph.ir import Graph, Op
from chronotope.plan.check import format_bytes
from chronotope.plan.plan import Plan
from chronotope.search.build import build, build_pipeline
from chronotope.search.constraints import (
    Constraints,
    Knob,
    Memory,
    joined,
    knob_values,
    pipeline_values,
    smallest,
)
from chronotope.search.drec import DRecError, joint
from chronotope.search.drec import Pipeline as DRecPipeline
from chronotope.search.ilp import NoFit, Solution, first_reads, solve, updates_cut
from chronotope.search.knobs import Knobs, Model, points
from chronotope.search.space import (
    TRAINING_FLOPS,
    ConstraintError,
    Mesh,
    Strategy,
    algo_label,
    constrain,
    meshes,
    nbytes,
    repeated,
    strategies,
)
from chronotope.search.stages import Pipeline, pipelines

METHODS = ("auto", "mesh", "ilp", "drec")
SIMULATED_UP_TO = 64  # devices up to which the finalists are simulated unless told: beyond,
# compiling one (a scaled unit of 64 ranks or more) takes minutes here
PER_OP_UP_TO = 64  # devices up to which "auto" also searches per op (ILP, D-Rec): beyond,
# their plans over every device are too large to build here
ROUNDS = 6  # solves at most, tightening the budget to the plan's own memory estimate
FINALISTS = 3  # the ILP's cheapest options that fit, built and simulated to pick one (and
# the cheapest pipeline, or plan over all devices, if none of them is one)


class SearchError(ChronotopeError):
    """No plan fits, or the search cannot run as asked."""


@dataclass
class SearchResult:
    plan: Plan
    method: str
    predicted_step_s: float  # the simulator's step time of the plan (or the search's model's)
    peak_memory_bytes: list[int]  # per device, the plan's estimate
    search_s: float  # deciding: strategies, solvers, stage DP (building, checking aside)
    variables: int  # of the ILPs solved
    # what was explored: the plan found and the ready-made ones, each simulated
    candidates: list[dict[str, Any]] = field(default_factory=list)
    choices: dict[str, str] = field(default_factory=dict)  # op -> strategy, for reading
    mesh: str = ""  # the layout of the plan found: "2x4", or "2 stages x 4, 8 micro-batches"
    explored: list[dict[str, Any]] = field(default_factory=list)  # each option's optimum
    timings: dict[str, float] = field(default_factory=dict)  # decide, build, check, simulate, bind
    simulated: bool = True  # the steps are the simulator's (else the search's cost model's)


class _Clock(dict):
    """Seconds spent per phase of a search."""

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self[phase] = self.get(phase, 0.0) + time.perf_counter() - start


def search(graph: Graph, devices: int, cluster: Cluster | str | None = None,
           memory: float | None = None, method: str = "auto",
           time_limit: float = 60.0, mesh: Sequence[int] | None = None,
           pipeline: bool = True, simulate: bool | None = None,
           constraints: Constraints | Mapping[str, Any] | str | Path | None = None,
           dtype: str = "fp32", replica: Callable[[int], Graph] | None = None
           ) -> SearchResult:
    """The cheapest plan of ``graph`` over ``devices`` that fits ``memory`` bytes per
    device by the plan's own estimate (default: the cluster's device memory; ``math.inf``
    for no limit), computing in ``dtype`` ("fp32", "bf16", "fp16": priced at its FLOP
    rate and memory, recorded in the plan).

    ``method``: ``"mesh"`` (the mesh policy's knobs, ``search/knobs.py``), ``"ilp"`` (the
    intra-op ILP over every mesh ``devices`` factors into, or ``mesh`` alone, ``(2, 4)``:
    two groups of four; and, unless ``pipeline`` is off or a mesh is given, pipelines by
    the stage DP), ``"drec"`` (the recursive bi-partition and its pipelines: no solver,
    devices a power of two), or ``"auto"``: the mesh policy's knobs, and up to
    ``PER_OP_UP_TO`` devices the other two; the one the simulator finds fastest.

    ``replica``: the graph of ``1 / r`` of the batch (``lambda r: ct.capture(workload.
    replica(r))``); with it the mesh family builds data parallelism as replicas of one
    group (``plan.scale``), whose plan is as small at 1,024 devices as at 16.

    ``constraints``: what the plan must keep to (``search/constraints.py``), as
    ``Constraints``, a TOML file's path or a mapping: knobs fixed or bounded (``{"tp": 4,
    "pp": [2, 4], "micro": {"min": 8}, "schedule": "zb1", "recompute": "full"}``) and op
    cuts, shell-style (``{"h.*.mlp.*": "split b*"}``: the MLPs only cut along a batch dim;
    ``{"kind:embedding": "replicate"}``). Only the families that have every knob named
    run; none that satisfies them all is an error naming the fewest that conflict and
    what falls short; each candidate says which of them bound it (dropping one would
    find a cheaper plan) or, ready-made, which it breaks.

    ``simulate``: compile and simulate the plans found and the ready-made data- and
    tensor-parallel plans to compare them (default: up to ``SIMULATED_UP_TO`` devices;
    off, the cheapest by the search's own cost model; ``"auto"`` then takes D-Rec's plan
    only where the ILP finds none, its symbolic cost not being seconds)."""
    if method not in METHODS:
        raise SearchError(f"unknown search method {method!r}: use {', '.join(METHODS)}")
    if devices < 1:
        raise SearchError(f"search needs at least one device, got {devices}")
    if mesh is not None and math.prod(mesh) != devices:
        raise SearchError(f"mesh {'x'.join(map(str, mesh))} has {math.prod(mesh)} devices, "
                          f"not {devices}")
    if dtype not in DTYPES:
        raise SearchError(f"unknown dtype {dtype!r}: use {', '.join(DTYPES)}")
    wanted = Constraints.parse(constraints)
    if method != "auto" and wanted.unhonoured(method):
        raise SearchError(f"method={method!r} cannot keep to "
                          f"{'; '.join(wanted.unhonoured(method))}: " + _who_can(wanted))
    if not isinstance(cluster, Cluster):
        cluster = cluster_for(devices, cluster)
    if simulate is None:
        simulate = devices <= SIMULATED_UP_TO
    if memory is None:
        memory = cluster.memory
    elif math.isinf(memory):
        memory = None
    start, clock = time.perf_counter(), _Clock()
    found: list[_Found] = []
    explored: list[dict[str, Any]] = []
    errors: list[SearchError] = []
    runs = {"mesh": lambda: _by_knobs(graph, devices, cluster, memory, dtype, replica,
                                      explored, clock, simulate, wanted),
            "ilp": lambda: _by_ilp(graph, devices, cluster, memory, time_limit, mesh,
                                   pipeline, explored, clock, simulate, wanted, dtype),
            "drec": lambda: _by_drec(graph, devices, cluster, memory, explored, clock, dtype)}
    names = [n for n in ("mesh", "ilp", "drec") if not wanted.unhonoured(n)] \
        if method == "auto" else [method]
    if not names:
        raise SearchError("no family of the search keeps to all the constraints: "
                          + _who_can(wanted))
    for name in names:
        if name == "mesh" and method == "auto" and mesh is not None:
            continue  # the mesh given is the per-op families'
        if name != "mesh" and method == "auto" and devices > PER_OP_UP_TO:
            continue
        if name == "drec" and method == "auto" and (mesh is not None or devices & (devices - 1)):
            continue  # D-Rec halves the devices: only powers of two, no given mesh
        if name == "drec" and method == "auto" and found and not simulate:
            continue  # its symbolic cost knows no latency: not comparable to the ILP's
        try:
            found.append(runs[name]())
        except SearchError as e:
            errors.append(e)
    if not found:
        raise errors[0]
    clock["decide"] = time.perf_counter() - start - sum(clock.values())
    with clock("simulate"):
        priced = [{**(f.priced or _simulated(f"searched ({f.method})", f.plan, cluster)
                      if simulate else
                      {"plan": f"searched ({f.method})", "predicted_step_s": f.model_s,
                       "peak_memory_bytes": max(f.peaks)}), "layout": f.layout}
                  for f in found]
        best = min(range(len(found)), key=lambda i: priced[i]["predicted_step_s"])
        candidates = [priced[best], *priced[:best], *priced[best + 1:]]
        for i, c in enumerate(priced):
            c["binding"] = found[i].binding
        if simulate and devices <= PER_OP_UP_TO:
            candidates += [c for c in (_ready_made(graph, devices, name, cluster, dtype,
                                                   wanted) for name in ("dp", "tp"))
                           if c is not None]
    for c in candidates:
        c["fits"] = memory is None or c["peak_memory_bytes"] <= memory
    f = found[best]
    return SearchResult(f.plan, f.method, priced[best]["predicted_step_s"], f.peaks,
                        clock["decide"], f.variables, candidates, f.choices, f.layout, explored,
                        dict(clock), simulate)


@dataclass
class _Found:
    method: str
    plan: Plan
    peaks: list[int]
    layout: str
    choices: dict[str, str]
    model_s: float  # the step time by the search's own cost model
    variables: int = 0
    priced: dict[str, Any] | None = None  # simulated already
    binding: list[str] = field(default_factory=list)  # constraints without which the
    # search's model finds a cheaper plan that fits


def _by_ilp(graph: Graph, devices: int, cluster: Cluster, memory: float | None,
            time_limit: float, mesh: Sequence[int] | None, pipeline: bool,
            explored: list[dict[str, Any]], clock: _Clock, simulate: bool,
            wanted: Constraints, dtype: str = "fp32") -> _Found:
    """The ILP on every mesh, the stage DP's pipelines: the cheapest by the cost model
    whose plan the plan's own memory estimate fits; simulating, the fastest in the
    simulator of the cheapest few that fit and the cheapest of the other family."""

    def cheapest(kept: Constraints, limit: float | None) -> float:
        return ilp_options(graph, devices, cluster, limit, time_limit, mesh, pipeline,
                           None, kept, dtype)[0][0][0]

    try:
        options, variables = ilp_options(graph, devices, cluster, memory, time_limit, mesh,
                                         pipeline, explored, wanted, dtype)
    except SearchError:
        if not wanted:
            raise
        raise SearchError(_conflict(wanted, memory, cheapest)) from None
    with clock("bind"):
        binding = _binding(wanted, options[0][0], lambda kept: cheapest(kept, memory))
    peak, why, fitting = None, [], []
    families: set[bool] = set()  # pipelines or not, among those that fit
    other = 0  # tries at one more, the cheapest of the other family, should the model err
    for seconds, option in options:
        family = isinstance(option, Pipeline)
        if len(fitting) >= (FINALISTS if simulate else 1):
            if not simulate or len(families) == 2 or other == FINALISTS:
                break
            if family in families:
                continue
            other += 1
        try:
            if isinstance(option, Pipeline):
                choice, plan, peaks = _pipeline_plan(graph, option, memory, clock, dtype)
                layout = option.label
            else:
                solution, plan, peaks = _fitted(graph, *option, cluster, memory, time_limit,
                                                clock, dtype)
                choice, layout, seconds = solution.choice, str(solution.mesh), solution.seconds
            fitting.append(_Found("ilp", plan, peaks, layout,
                                  {op.name: s.label for op, s in choice.items()}, seconds,
                                  variables))
            families.add(family)
        except _TooBig as e:
            peak = e.peak if peak is None else min(peak, e.peak)
        except PlanError as e:  # a cut that micro-batches do not divide, say
            why.append(str(e))
    if not fitting:
        raise SearchError(_too_big(memory, peak or 0.0) if peak is not None else
                          "no plan found could be built: " + "; ".join(why[:2]))
    for f in fitting:
        f.binding = binding
    return _fastest(fitting, cluster, explored, clock)


def _by_knobs(graph: Graph, devices: int, cluster: Cluster, memory: float | None,
              dtype: str, replica: Callable[[int], Graph] | None,
              explored: list[dict[str, Any]], clock: _Clock, simulate: bool,
              wanted: Constraints) -> _Found:
    """The mesh policy's knobs, each point priced by ``knobs.Model``: the cheapest few that
    fit built and checked by the plan's own memory estimate (a point the estimate finds
    too big gives way to the next that would fit were the model as far off for it), the
    fastest of them in the simulator."""
    model = Model(graph, cluster, dtype)
    space = points(model, devices, cluster.per_node, replicas=replica is not None)
    ranked = sorted((model.price(k) for k in space), key=lambda p: p.seconds)
    if not ranked:
        raise SearchError(f"no mesh over {devices} devices divides the batch of "
                          f"{graph.batch_size} and the model's blocks")
    values = [knob_values(p.knobs) for p in ranked]

    def cheapest(kept: Constraints, limit: float | None) -> float:
        return min((p.seconds for p, v in zip(ranked, values, strict=True)
                    if (limit is None or p.memory <= limit) and kept.admits(v)),
                   default=math.inf)

    fitting = [p for p, v in zip(ranked, values, strict=True)
               if (memory is None or p.memory <= memory) and wanted.admits(v)]
    if not fitting and wanted:
        raise SearchError(_conflict(wanted, memory, cheapest, ranked, values, devices))
    if not fitting:
        least = min(ranked, key=lambda p: p.memory)
        raise SearchError(
            f"no plan over {devices} devices fits {format_bytes(memory or 0)} per device: "
            f"the least any point of the space needs is about {format_bytes(least.memory)} "
            f"({least.knobs.label}; {format_bytes(least.states)} of it weights, gradients and "
            f"optimizer state); give more memory or devices, or compute in 16 bits")
    found: list[_Found] = []
    finalists = FINALISTS if simulate else 1
    margin, built = 1.0, 0  # the most the estimate exceeded the model by, on points built
    for p in fitting:
        if len(found) == finalists or built == 8 * finalists:
            break
        if memory is not None and p.memory * margin > memory:
            continue  # would not fit by the estimate either, as the model misses by so far
        built += 1
        try:
            plan, peaks = _knobs_plan(graph, p.knobs, dtype, replica, clock)
        except PlanError as e:  # a barrier no micro-batch runs alone, say
            explored.append({"method": "mesh", "option": p.knobs.label,
                             "model_step_s": p.seconds, "refused": str(e)})
            continue
        explored.append({"method": "mesh", "option": p.knobs.label, "model_step_s": p.seconds,
                         "model_memory_bytes": p.memory, "peak_memory_bytes": max(peaks)})
        margin = max(margin, max(peaks) / p.memory)
        if memory is None or max(peaks) <= memory:
            found.append(_Found("mesh", plan, peaks, p.knobs.label,
                                {op.name: s.label for op, s in
                                 model.choice(p.knobs.tp, p.knobs.sequence).items()},
                                p.seconds))
    if not found:
        tried = "; ".join(f"{e['option']}: " + (e.get("refused") or
                                                 format_bytes(e["peak_memory_bytes"]))
                          for e in explored if e["method"] == "mesh")
        raise SearchError(f"the cheapest points that fit {format_bytes(memory or 0)} by the "
                          "search's model could not be built or do not fit by the plan's "
                          f"estimate: {tried[:400]}")
    with clock("bind"):
        binding = _binding(wanted, fitting[0].seconds, lambda kept: cheapest(kept, memory))
    for f in found:
        f.binding = binding
    return _fastest(found, cluster, explored, clock)


def _fastest(found: list[_Found], cluster: Cluster, explored: list[dict[str, Any]],
             clock: _Clock) -> _Found:
    """The one plan found, or the fastest in the simulator of several (the cost model
    ranks, the simulator picks among the best few)."""
    if len(found) == 1:
        return found[0]
    with clock("simulate"):
        for f in found:
            f.priced = _simulated(f"searched ({f.method})", f.plan, cluster)
            explored.append({"method": f.method, "option": f.layout, "model_step_s": f.model_s,
                             "simulated_step_s": f.priced["predicted_step_s"]})
    return min(found, key=lambda f: f.priced["predicted_step_s"])


def _knobs_plan(graph: Graph, knobs: Knobs, dtype: str,
                replica: Callable[[int], Graph] | None, clock: _Clock
                ) -> tuple[Plan, list[int]]:
    """The point's plan and its estimate: data parallelism as replicas of one group where
    each replica can run alone, else written into the plan."""
    if replica is not None and knobs.dp > 1:
        try:
            with clock("build"):
                plan = knobs.plan(graph, dtype, replica)
            return plan, _peaks(plan, clock)
        except PlanError:  # an op that needs every replica's rows
            pass
    with clock("build"):
        plan = knobs.plan(graph, dtype)
    return plan, _peaks(plan, clock)


def ilp_options(graph: Graph, devices: int, cluster: Cluster, memory: float | None,
                time_limit: float = 60.0, mesh: Sequence[int] | None = None,
                pipeline: bool = True, explored: list[dict[str, Any]] | None = None,
                constraints: Constraints | None = None, dtype: str = "fp32"
                ) -> tuple[list[tuple[float, Any]], int]:
    """The ILP's decision, nothing built: its optimum on every mesh (or ``mesh``) as
    ``(solution, space, groups)`` and the stage DP's pipelines, cheapest first by the cost
    model, those the ``constraints`` admit; and the variables solved.
    Raises SearchError naming what binds when nothing fits ``memory``."""
    explored = [] if explored is None else explored
    constraints = constraints or Constraints()
    options: list[tuple[float, Any]] = []
    least, variables, refused = None, 0, []
    whole = Plan(graph, 1)  # the whole-op pieces every mesh's strategies start from
    shapes = meshes(devices, cluster.per_node) if mesh is None else [Mesh(tuple(mesh))]
    for shape in shapes if constraints.admits(pipeline_values(1, 1)) else []:
        try:
            space = constrain(graph, strategies(graph, shape, cluster, whole=whole,
                                                dtype=dtype), constraints.cuts)
        except ConstraintError as e:  # a cut the constraints name that this mesh has not
            refused.append(f"mesh {shape}: {e}")
            continue
        groups = repeated(graph, space)
        try:
            solution = solve(graph, space, shape, cluster, memory, time_limit=time_limit,
                             groups=groups)
        except NoFit as e:
            least = e.least if least is None else min(least, e.least)
            explored.append({"method": "ilp", "option": f"mesh {shape}", "model_step_s": None})
            continue
        variables += solution.variables
        options.append((solution.seconds, (solution, space, groups)))
        explored.append({"method": "ilp", "option": f"mesh {shape}",
                         "model_step_s": solution.seconds})
    if pipeline and mesh is None and devices > 1:
        for stages in pipelines(graph, devices, cluster, memory, time_limit, constraints,
                                dtype):
            variables += sum(sol.variables for sol in stages.solutions)
            options.append((stages.seconds, stages))
            explored.append({"method": "ilp", "option": stages.label,
                             "model_step_s": stages.seconds})
    if not options and least is None and refused:
        raise SearchError("; ".join(refused[:2]))
    if not options and least is None:
        raise SearchError(f"no mesh or pipeline over {devices} devices keeps to "
                          f"{joined(constraints)}: the ILP tries one mesh (pp 1, one "
                          "micro-batch) and pipelines of stages dividing the devices, s, 2s "
                          f"or 4s micro-batches dividing the batch of {graph.batch_size}")
    if not options:
        space = strategies(graph, devices, cluster, whole=whole, dtype=dtype)
        raise SearchError(_no_fit(graph, space, devices, memory, least or 0.0))
    options.sort(key=lambda option: option[0])
    return options, variables


def _by_drec(graph: Graph, devices: int, cluster: Cluster, memory: float | None,
             explored: list[dict[str, Any]], clock: _Clock, dtype: str = "fp32") -> _Found:
    """D-Rec's plan over all devices, or its pipeline of D-Rec plans over fewer (the
    thesis's joint search), the cheapest by its symbolic cost that fits."""
    batch = graph.batch_size or 1
    micro = max(m for m in (1, 2, 4, 8, 16) if batch % m == 0)
    # compute in the unit of the symbolic cost (an element sent within a node)
    traffic, per_second = Traffic(graph, dtype), cluster.intra.bandwidth / 4
    compute = {op: TRAINING_FLOPS * per_second * cluster.compute(
        op_flops(op), traffic.forward(op, [t.meta.numel for t in op.inputs],
                                      [t.meta.numel for t in op.outputs]), dtype)
        for op in graph.ops}
    built: dict[int, tuple[Plan, list[int]]] = {}

    def fits(stages: DRecPipeline) -> bool:
        try:
            with clock("build"):
                plan = _drec_plan(graph, devices, stages, micro)
                plan.dtype = dtype
        except PlanError:
            return False
        peaks = _peaks(plan, clock)
        explored.append({"method": "drec", "option": _drec_label(devices, stages, micro),
                         "model_cost": stages.cost, "fits": memory is None or
                         max(peaks) <= memory})
        built[id(stages)] = plan, peaks
        return memory is None or max(peaks) <= memory

    try:
        best = joint(graph, devices, micro=micro, compute=compute, fits=fits)
    except DRecError as e:
        raise SearchError(f"D-Rec: {e}") from None
    plan, peaks = built[id(best)]
    labels = {op: " x ".join(algo_label(a) for a in algos) for op, algos in best.choice.items()}
    return _Found("drec", plan, peaks, _drec_label(devices, best, micro),
                  {op.name: label or "whole" for op, label in labels.items()},
                  best.cost * 4 / cluster.intra.bandwidth)  # elements sent within a node


def _drec_plan(graph: Graph, devices: int, found: DRecPipeline, micro: int) -> Plan:
    width = devices // found.stages
    rounds = width.bit_length() - 1
    if found.stages == 1:
        return build(graph, (2,) * rounds or (1,), found.choice)
    return build_pipeline(graph, width, found.stage_of, micro, found.choice)


def _drec_label(devices: int, found: DRecPipeline, micro: int) -> str:
    width = devices // found.stages
    return str(Mesh((2,) * (width.bit_length() - 1) or (1,))) if found.stages == 1 else \
        f"{found.stages} stages x {width}, {micro} micro-batches"


class _TooBig(Exception):
    def __init__(self, peak: float) -> None:
        super().__init__(peak)
        self.peak = peak


def _fitted(graph: Graph, solution: Solution, space, groups, cluster: Cluster,
            memory: float | None, time_limit: float, clock: _Clock, dtype: str = "fp32"
            ) -> tuple[Solution, Plan, list[int]]:
    """The solution's plan, solved again with a tighter budget until the plan's own memory
    estimate fits: the solver counts activations coarsely, the estimate by liveness."""
    budget = memory
    for _ in range(ROUNDS):
        with clock("build"):
            plan = solution_plan(graph, solution, dtype)
        peaks = _peaks(plan, clock)
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


def solution_plan(graph: Graph, solution: Solution, dtype: str = "fp32") -> Plan:
    """The plan of an ILP solution over its mesh, updates cut where it chose ZeRO."""
    plan = build(graph, solution.mesh.shape, {op: s.algos for op, s in solution.choice.items()},
                 zero_weights(graph, solution.choice))
    plan.dtype = dtype
    return plan


def _pipeline_plan(graph: Graph, found: Pipeline, memory: float | None, clock: _Clock,
                   dtype: str = "fp32") -> tuple[dict[Op, Strategy], Plan, list[int]]:
    choice = {op: s for sol in found.solutions for op, s in sol.choice.items()}
    with clock("build"):
        plan = build_pipeline(graph, found.stage_devices, found.stage_of, found.micro,
                              {op: s.algos for op, s in choice.items()},
                              zero=zero_weights(graph, choice))
        plan.dtype = dtype
    peaks = _peaks(plan, clock)
    if memory is not None and max(peaks) > memory:
        raise _TooBig(max(peaks))
    return choice, plan, peaks


def _peaks(plan: Plan, clock: _Clock) -> list[int]:
    with clock("check"):
        checked = plan.check()
    return [checked.memory[d].total for d in range(plan.ndevices)]


def zero_weights(graph: Graph, choice: dict[Op, Strategy]) -> list[str]:
    """The weights whose first reader chose to cut their updates over its devices."""
    names = {id(t): name for name, t in graph.params.items()}
    return [names[id(op.inputs[i])] for op, first in first_reads(graph.ops).items()
            if op in choice for i in first if updates_cut(op, choice[op], i)]


def _simulated(name: str, plan: Plan, cluster: Cluster) -> dict[str, Any]:
    from chronotope.compile import compile as compile_plan
    from chronotope.compile.simulate import simulate

    sim = simulate(compile_plan(plan, cluster=cluster), cluster)
    checked = plan.check()
    return {"plan": name, "predicted_step_s": sim.step_time,
            "peak_memory_bytes": max(checked.memory[d].total for d in range(plan.ndevices))}


def _ready_made(graph: Graph, devices: int, name: str, cluster: Cluster, dtype: str,
                wanted: Constraints) -> dict[str, Any] | None:
    from chronotope.policies import ParallelConfig, make

    try:
        plan = make(graph, ParallelConfig(name, devices))
        plan.dtype = dtype
        degrees = {"dp": devices} if name == "dp" else {"tp": devices}
        return {**_simulated(name, plan, cluster), "violates": wanted.violated(degrees)}
    except PlanError:
        return None


def _who_can(wanted: Constraints) -> str:
    """Which family keeps to each constraint some family cannot."""
    def able(c: Any) -> str:
        names = [f"method={f!r}" for f in ("mesh", "ilp") if not Constraints([c]).unhonoured(f)]
        return " or ".join(names) or "no method"

    return "; ".join(f"{c.name}: {able(c)}" for c in wanted
                     if any(Constraints([c]).unhonoured(f) for f in ("mesh", "ilp")))


def _binding(wanted: Constraints, best: float,
             cheapest: Callable[[Constraints], float]) -> list[str]:
    """The constraints without which (the others kept) the search's model finds a plan
    that fits and is cheaper than ``best``."""
    def cheaper(c: Any) -> bool:
        try:
            return cheapest(wanted.without(c)) < best * (1 - 1e-9)
        except SearchError:
            return False
    return [c.name for c in wanted if cheaper(c)]


def _conflict(wanted: Constraints, memory: float | None,
              cheapest: Callable[[Constraints, float | None], float],
              ranked: Sequence[Any] = (), values: Sequence[dict[str, Any]] = (),
              devices: int = 0) -> str:
    """The fewest constraints (the memory per device among them) that no plan keeps to
    together, and what falls short: the memory the least of them needs, or the values the
    space has of each degree named."""
    given = [*wanted, *([Memory(memory)] if memory is not None else [])]

    def split(cs: Sequence[Any]) -> tuple[Constraints, float | None]:
        return (Constraints(c for c in cs if not isinstance(c, Memory)),
                next((c.limit for c in cs if isinstance(c, Memory)), None))

    def feasible(cs: Sequence[Any]) -> bool:
        try:
            return cheapest(*split(cs)) < math.inf
        except SearchError:
            return False

    subset = smallest(given, feasible)
    kept, limit = split(subset)
    head = f"no plan keeps to {joined(subset)}" + (" together" if len(subset) > 1 else "")
    if not ranked:  # the ILP's: its own message for just these says what falls short
        try:
            cheapest(kept, limit)
        except SearchError as e:
            return f"{head}: {e}"
        return head
    if limit is not None:
        least = min((p for p, v in zip(ranked, values, strict=True) if kept.admits(v)),
                    key=lambda p: p.memory)
        return (f"{head}: the least a plan of {joined(kept) or 'the space'} needs is about "
                f"{format_bytes(least.memory)} ({least.knobs.label}), "
                f"{format_bytes(least.memory - limit)} over; drop or widen one, or give more "
                "memory or devices")
    has = []
    for c in kept:
        if isinstance(c, Knob):
            rest = kept.without(c)
            seen = sorted({v[c.knob] for v in values if rest.admits(v)}, key=str)
            has.append(f"{c.knob} can be {', '.join(map(str, seen)) or 'nothing'}"
                       + (f" with {joined(rest)}" if rest else ""))
    return (f"{head}: over {devices} devices " + "; ".join(has) +
            " (degrees divide the devices and the batch, tp stays within a node)")


def explain(result: SearchResult) -> dict[str, Any]:
    """The plan found, for reading: its layout, stages and their layers, recompute,
    storage and dtype; what fills its fullest device most; and the runners-up."""
    plan = result.plan
    checked = plan.check()
    device = max(checked.memory, key=lambda d: checked.memory[d].total)
    m = checked.memory[device]
    terms = {"weights": m.params, "gradients": m.grads, "optimizer state": m.optimizer,
             "activations": m.activations}
    stages: dict[Any, set[str]] = {}
    for (_, stage, _), pieces in plan.cells.items():
        stages.setdefault(stage, set()).update(
            p.op.source.module for p in pieces if p.op.source and p.op.source.module)
    kept = {"read": "", "owned": "weights kept only as owned (ZeRO-3)"}
    return {
        "layout": result.mesh, "method": result.method, "dtype": plan.dtype,
        "devices": plan.world_size, "replicas": plan.replicas, "micro_batches": plan.micro,
        "stages": {str(s): _layers(mods) for s, mods in sorted(  # by number, then by name
            stages.items(), key=lambda kv: (not isinstance(kv[0], int), str(kv[0]).zfill(9)))},
        "recomputed_ops": len({p.op.name for p in plan.recomputed}),
        "storage": kept.get(plan.param_storage, plan.param_storage) or
        (f"updates of {len(plan.updates)} weights cut over their devices (ZeRO)"
         if plan.updates else "every device updates the weights it holds") + (
            f"; the optimizer state shared out over the {plan.replicas} replicas (ZeRO-1)"
            if plan.shard_optimizer else ""),
        "swapped_ops": len({p.op.name for p in plan.swapped}),
        "binding": {"device": device, "term": max(terms, key=terms.__getitem__),
                    "bytes": terms, "total": m.total},
        "runners_up": _runners_up(result),
    }


def _runners_up(result: SearchResult) -> list[dict[str, Any]]:
    """The other options explored, each once: simulated where it was, else by the model."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for e in result.explored:
        if e.get("model_step_s") is None or e.get("refused") or \
                e["option"] in (result.mesh, f"mesh {result.mesh}"):
            continue
        row = seen.setdefault((e["method"], e["option"]), {
            "option": e["option"], "method": e["method"], "step_s": e["model_step_s"],
            "peak_memory_bytes": None})
        if "simulated_step_s" in e:
            row["step_s"] = e["simulated_step_s"]
        row["peak_memory_bytes"] = e.get("peak_memory_bytes") or row["peak_memory_bytes"]
    return sorted(seen.values(), key=lambda r: r["step_s"])[:5]


def _layers(modules: set[str]) -> str:
    """``h.0`` to ``h.5`` as ``h.0-5``, what else a stage runs named beside it."""
    numbered: dict[str, list[int]] = {}
    other = set()
    for mod in modules:
        parts = mod.split(".")
        at = next((i for i, x in enumerate(parts) if x.isdigit()), None)
        if at is None:
            other.add(parts[0])
        else:
            numbered.setdefault(".".join(parts[:at]), []).append(int(parts[at]))
    runs = [f"{k}.{min(v)}-{max(v)}" if min(v) != max(v) else f"{k}.{v[0]}"
            for k, v in sorted(numbered.items())]
    return ", ".join(runs + sorted(other))


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
        cut = any(is_shard(lay) for op in readers for s in space[op]
                  for lay in s.inputs[op.inputs.index(t)])
        held = 4 * nbytes(t) / (devices if cut else 1)
        states += held
        if held > worst_bytes:
            worst, worst_bytes = t, held
    largest = f" (the most: {worst.name}, {format_bytes(worst_bytes)})" if worst else ""
    over = f" ({format_bytes(least - memory)} over)" if memory else ""
    return (f"no plan over {devices} devices fits {format_bytes(memory or 0)} per device: the "
            f"least any needs is about {format_bytes(least)}{over}: weights, gradients and "
            f"optimizer state {format_bytes(states)} at their best cut{largest}, activations "
            "the rest; give more memory or devices")


__all__ = ["METHODS", "Constraints", "SearchError", "SearchResult", "explain", "ilp_options",
           "search"]
