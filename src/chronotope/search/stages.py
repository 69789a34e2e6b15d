"""Inter-op search (Alpa's stage DP): contiguous runs of ops as pipeline stages, each on
its own equal share of the devices, each cut by the intra-op ILP.

For ``s`` stages of ``d = devices / s`` devices and ``B`` micro-batches:

1. the whole graph is solved once on each mesh of ``d`` devices for one micro-batch
   (no memory limit): the best mesh, and each op's time under it;
2. a dynamic program cuts the ops, only where the fewest batch activations cross
   (between blocks), into ``s`` runs minimising the slowest run's time;
3. each stage is solved again on its own, within the memory limit, holding as many
   micro-batches' activations at once as 1F1B keeps in flight on it (``s - i``);
4. the step takes ``sum(t_i) + (B - 1) * max(t_i)`` (1F1B's fill, steady state and
   drain) plus the slowest stage's gradient reductions.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from chronotope.cost.network import Cluster
from chronotope.graph.ir import Graph, Op
from chronotope.plan.plan import differentiable
from chronotope.policies.axes import batch_dims
from chronotope.policies.mesh import _crossing
from chronotope.search.ilp import NoFit, Solution, _edge, solve
from chronotope.search.space import (
    Mesh,
    Pricer,
    Strategy,
    meshes,
    nbytes,
    repeated,
    strategies,
)


@dataclass
class Pipeline:
    """A pipeline the stage DP found: its stages' ops and intra-op solutions."""

    stage_of: dict[Op, int]
    micro: int
    solutions: list[Solution]  # one per stage, on its own devices
    seconds: float  # the model's step time

    @property
    def stages(self) -> int:
        return len(self.solutions)

    @property
    def stage_devices(self) -> int:
        return self.solutions[0].mesh.devices

    @property
    def label(self) -> str:
        return f"{self.stages} stages x {self.solutions[0].mesh}, {self.micro} micro-batches"


def pipelines(graph: Graph, devices: int, cluster: Cluster, memory: float | None,
              time_limit: float = 60.0) -> list[Pipeline]:
    """Every pipeline the DP finds that fits, cheapest first: stage counts that divide the
    devices, micro-batches from one to four per stage that divide the batch."""
    batch = graph.inputs[0].shape[0] if graph.inputs and graph.inputs[0].shape else 1
    cuts = cut_positions(graph)
    found = []
    spaces: dict[Mesh, tuple[dict, dict]] = {}
    for s in range(2, min(devices, len(cuts) + 1) + 1):
        if devices % s:
            continue
        for micro in (m for m in (s, 2 * s, 4 * s) if batch % m == 0):
            best = _pipeline(graph, s, devices // s, micro, cuts, cluster, memory, spaces,
                             time_limit)
            if best is not None:
                found.append(best)
    return sorted(found, key=lambda p: p.seconds)


def cut_positions(graph: Graph) -> list[int]:
    """Where a stage may begin: before an op where the fewest batch activations made
    earlier are still read (one, the residual stream, between transformer blocks)."""
    batch_dim = batch_dims(graph)
    crossing = _crossing(graph.ops, {t for op in graph.ops if batch_dim[op] is not None
                                     for t in op.outputs})
    batched = [i for i, op in enumerate(graph.ops) if batch_dim[op] is not None]
    if len(batched) < 2:
        return []
    inner = range(batched[0] + 1, batched[-1] + 1)  # batched ops on both sides
    fewest = min(crossing[i] for i in inner)
    return [i for i in inner if crossing[i] == fewest]


def _pipeline(graph: Graph, stages: int, d: int, micro: int, cuts: list[int],
              cluster: Cluster, memory: float | None, spaces: dict, time_limit: float
              ) -> Pipeline | None:
    whole = None
    for mesh in meshes(d):
        space, groups = _space(graph, mesh, cluster, spaces)
        solution = solve(graph, space, mesh, cluster, None, time_limit=time_limit,
                         groups=groups, micro=micro)
        if whole is None or solution.seconds < whole.seconds:
            whole = solution
    assert whole is not None
    space, groups = _space(graph, whole.mesh, cluster, spaces)
    bounds = split(op_seconds(graph, whole.choice, whole.mesh, cluster, micro), cuts, stages)
    stage_of = {op: next(s for s in range(stages) if op_index < bounds[s + 1])
                for op_index, op in enumerate(graph.ops)}
    solutions = []
    for s in range(stages):
        ops = graph.ops[bounds[s]:bounds[s + 1]]
        try:
            solutions.append(solve(graph, space, whole.mesh, cluster, memory,
                                   time_limit=time_limit, groups=groups, ops=ops,
                                   micro=micro, in_flight=min(stages - s, micro)))
        except NoFit:
            return None
    times = [sol.seconds - sol.sync for sol in solutions]
    for s in range(stages - 1):  # what crosses each cut, sent every micro-batch both ways
        seconds = _crossing_seconds(graph, bounds[s + 1], micro, (s * d, (s + 1) * d), cluster)
        times[s] += seconds
        times[s + 1] += seconds
    seconds = sum(times) + (micro - 1) * max(times) + max(sol.sync for sol in solutions)
    return Pipeline(stage_of, micro, solutions, seconds)


def _crossing_seconds(graph: Graph, cut: int, micro: int, pair: tuple[int, int],
                      cluster: Cluster) -> float:
    """Sending a micro-batch's share of what ops before ``cut`` make and ops after it read
    to the next stage, and its gradient back."""
    before = {t for op in graph.ops[:cut] for t in op.outputs}
    needs_grad = differentiable(graph)
    crossing = {t for op in graph.ops[cut:] for t in op.inputs if t in before}
    forward = sum(nbytes(t) for t in crossing) / micro
    backward = sum(nbytes(t) for t in crossing if t in needs_grad) / micro
    return sum(cluster.collective("send", size, [pair]) for size in (forward, backward) if size)


def _space(graph: Graph, mesh: Mesh, cluster: Cluster, spaces: dict
           ) -> tuple[dict[Op, list[Strategy]], dict[Op, Hashable]]:
    if mesh not in spaces:
        space = strategies(graph, mesh, cluster)
        spaces[mesh] = (space, repeated(graph, space))
    return spaces[mesh]


def op_seconds(graph: Graph, choice: dict[Op, Strategy], mesh: Mesh, cluster: Cluster,
               micro: int) -> list[float]:
    """Each op's time on one micro-batch under ``choice``: its compute and the layout
    changes of what it reads (the gradient reductions aside: once a step)."""
    pricer, needs_grad = Pricer(mesh, cluster), differentiable(graph)
    out = []
    for op in graph.ops:
        s = choice.get(op)
        seconds = 0.0 if s is None else s.compute / micro
        for i, t in enumerate(op.inputs):
            if s is not None and t.producer in choice:
                made = choice[t.producer].outputs[t.producer.outputs.index(t)]
                seconds += _edge(made, s, i, t, pricer, needs_grad, micro)
        out.append(seconds)
    return out


def split(seconds: Sequence[float], cuts: Sequence[int], stages: int) -> list[int]:
    """Stage bounds ``[0, c1, ..., len(seconds)]`` at ``cuts`` that minimise the slowest
    stage's total (then the sum of squares, for balance)."""
    before = [0.0]
    for x in seconds:
        before.append(before[-1] + x)
    points = [0, *cuts, len(seconds)]
    n = len(points)
    # best[k][j]: (slowest, squares) of k stages covering ops up to points[j]
    inf = (float("inf"), float("inf"))
    best = [[inf] * n for _ in range(stages + 1)]
    back = [[0] * n for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        for j in range(1, n):
            for i in range(j):
                if best[k - 1][i] == inf:
                    continue
                t = before[points[j]] - before[points[i]]
                cand = (max(best[k - 1][i][0], t), best[k - 1][i][1] + t * t)
                if cand < best[k][j]:
                    best[k][j], back[k][j] = cand, i
    bounds, j = [len(seconds)], n - 1
    for k in range(stages, 0, -1):
        j = back[k][j]
        bounds.append(points[j])
    return bounds[::-1]
