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

A weight two stages read (tied embeddings) is read as data parallelism reads it on
both, its update not cut: its gradient is then one all-reduce over both stages'
devices, priced as such. Where a reader cannot read it so (a transpose of the weight),
stages are one device wide.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

from chronotope.compile.rvd import PARTIAL
from chronotope.cost.network import Cluster
from chronotope.graph.axes import batch_dims, loss_tails
from chronotope.graph.ir import Graph, Op, PTensor, TensorKind
from chronotope.plan.algo import Split
from chronotope.plan.plan import Plan, differentiable
from chronotope.policies.mesh import _crossing
from chronotope.search.constraints import Constraints, pipeline_values
from chronotope.search.ilp import NoFit, Solution, _edge, solve
from chronotope.search.space import (
    ConstraintError,
    Mesh,
    Pricer,
    Strategy,
    constrain,
    data_parallel_read,
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
              time_limit: float = 60.0, constraints: Constraints | None = None,
              dtype: str = "fp32") -> list[Pipeline]:
    """Every pipeline the DP finds that fits, cheapest first: stage counts that divide the
    devices, micro-batches from one to four per stage that divide the batch, those the
    ``constraints`` admit (and their cuts)."""
    batch = graph.batch_size or 1
    cuts = cut_positions(graph)
    needs_grad = differentiable(graph)
    crossed = {c: crossing_bytes(graph, c, needs_grad) for c in cuts}
    found = []
    constraints = constraints or Constraints()
    spaces = _Spaces(graph, cluster, constraints.cuts, dtype)
    solved: dict[tuple, tuple[list[Op], Solution]] = {}  # stages alike are solved once
    for s in range(2, min(devices, len(cuts) + 1) + 1):
        micros = [m for m in (s, 2 * s, 4 * s)
                  if batch % m == 0 and constraints.admits(pipeline_values(s, m))]
        if devices % s or not micros:
            continue
        d = devices // s
        whole = None
        for mesh in meshes(d, cluster.per_node):
            try:
                space, groups = spaces.on(mesh, s)
            except ConstraintError:
                continue  # a cut the constraints name that this mesh does not have
            solution = solve(graph, space, mesh, cluster, None, time_limit=time_limit,
                             groups=groups, micro=s)
            if whole is None or solution.seconds < whole.seconds:
                whole = solution
        if whole is None:
            continue
        sends = {c: _sent(crossed[c], s, (0, d), cluster) for c in cuts}  # before the
        # split, no cut knows its devices: priced between the first two stages'
        seconds = op_seconds(graph, whole.choice, whole.mesh, cluster, s)
        bounds = stage_bounds(seconds, cuts, s, sends)
        stages = [graph.ops[bounds[i]:bounds[i + 1]] for i in range(s)]
        stage_of = {op: i for i, ops in enumerate(stages) for op in ops}
        shared = shared_weights(graph, stage_of)
        for micro in micros:
            restricted = _whole_where_shared(*spaces.on(whole.mesh, micro), shared, whole.mesh)
            restricted = restricted and _summed_where_crossing(*restricted, stage_of)
            if restricted is None:
                break
            space, groups = restricted
            solutions = [_stage(graph, ops, space, groups, whole.mesh, cluster, memory,
                                micro, min(s - i, micro), time_limit, solved)
                         for i, ops in enumerate(stages)]
            if any(sol is None for sol in solutions):
                continue
            found.append(Pipeline(stage_of, micro, solutions,
                                  _step_seconds(solutions, [crossed[c] for c in bounds[1:-1]],
                                                micro, cluster) +
                                  _shared_seconds(shared, stage_of, whole.mesh, cluster)))
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
    at = set(batched)
    cuts: list[int] = []
    for i in inner:  # not two with no batched op between: a stage of none has no micro-batch
        if crossing[i] == fewest and (not cuts or any(j in at for j in range(cuts[-1], i))):
            cuts.append(i)
    return cuts


def shared_weights(graph: Graph, stage_of: dict[Op, int]) -> dict[PTensor, list[Op]]:
    """Trainable weights read by ops of two or more stages, and those ops."""
    readers: dict[PTensor, list[Op]] = {}
    for op in graph.ops:
        for t in op.inputs:
            if t.kind is TensorKind.PARAM and not t.frozen:
                readers.setdefault(t, []).append(op)
    return {t: ops for t, ops in readers.items() if len({stage_of[op] for op in ops}) > 1}


def _whole_where_shared(space: dict[Op, list[Strategy]], groups: dict[Op, Hashable],
                        shared: dict[PTensor, list[Op]], mesh: Mesh
                        ) -> tuple[dict[Op, list[Strategy]], dict[Op, Hashable]] | None:
    """Readers of a weight two stages share keep only the strategies that read it as data
    parallelism does (whole, its gradient a partial sum on every axis) with its update
    not cut: each such reader decided on its own, out of its group. None where a reader
    has no such strategy (a transpose of the weight, replicated): its copies' gradients
    would reach the other stage as messages, not one all-reduce."""
    if not shared or mesh.devices == 1:
        return space, groups
    space, groups = dict(space), dict(groups)
    for t, readers in shared.items():
        for op in readers:
            space[op] = [st for st in space[op] if not st.zero and all(
                data_parallel_read(st, i) for i, x in enumerate(op.inputs) if x is t)]
            if not space[op]:
                return None
            groups.pop(op, None)
    return space, groups


def _summed_where_crossing(space: dict[Op, list[Strategy]], groups: dict[Op, Hashable],
                           stage_of: dict[Op, int]
                           ) -> tuple[dict[Op, list[Strategy]], dict[Op, Hashable]] | None:
    """Ops whose outputs a later stage reads keep only the strategies that make those
    outputs whole or sliced, not partial sums: a stage's ILP does not see the boundary,
    and partial sums would cross it one per device to every reader (each decided on its
    own, out of its group). None where such an op has no other strategy."""
    crossing: dict[Op, set[int]] = {}
    for op in stage_of:
        for t in op.inputs:
            if t.producer in stage_of and stage_of[t.producer] != stage_of[op]:
                crossing.setdefault(t.producer, set()).add(t.producer.outputs.index(t))
    if not crossing:
        return space, groups
    space, groups = dict(space), dict(groups)
    for op, outs in crossing.items():
        space[op] = [st for st in space[op]
                     if not any(PARTIAL in st.outputs[i] for i in outs)]
        if not space[op]:
            return None
        groups.pop(op, None)
    return space, groups


def _shared_seconds(shared: dict[PTensor, list[Op]], stage_of: dict[Op, int], mesh: Mesh,
                    cluster: Cluster) -> float:
    """What a shared weight's all-reduce over its stages' devices adds to the one over a
    stage's own (which the stage's solution priced)."""
    d = mesh.devices
    total = 0.0
    for t, readers in shared.items():
        stages = sorted({stage_of[op] for op in readers})
        ranks = tuple(r for st in stages for r in range(st * d, (st + 1) * d))
        total += max(0.0, cluster.collective("all_reduce", nbytes(t), [ranks]) -
                     cluster.collective("all_reduce", nbytes(t), [ranks[:d]]))
    return total


def _stage(graph: Graph, ops: list[Op], space, groups, mesh: Mesh, cluster: Cluster,
           memory: float | None, micro: int, in_flight: int, time_limit: float,
           solved: dict) -> Solution | None:
    """A stage's fastest cut over its devices that holds ``in_flight`` micro-batches within
    ``memory``: a stage made of the same ops as one solved before (the same layers)
    reuses its solution where that fits."""
    key = (tuple(groups.get(op, op) for op in ops), mesh, micro,
           tuple(len(space[op]) for op in ops))  # readers of a shared weight choose from fewer
    if key not in solved:
        solved[key] = ops, solve(graph, space, mesh, cluster, None, time_limit=time_limit,
                                 groups=groups, ops=ops, micro=micro)
    alike, fastest = solved[key]
    if memory is None or fastest.memory + (in_flight - 1) * fastest.held <= memory:
        return replace(fastest, choice={op: fastest.choice[a] for op, a in zip(ops, alike)
                                        if a in fastest.choice})
    try:
        return solve(graph, space, mesh, cluster, memory, time_limit=time_limit,
                     groups=groups, ops=ops, micro=micro, in_flight=in_flight)
    except NoFit:
        return None


def _step_seconds(solutions: list[Solution], crossed: list[tuple[int, int]], micro: int,
                  cluster: Cluster) -> float:
    """1F1B: every stage's micro-batch time and every cut's messages once (fill and
    drain), the slowest stage's ``micro - 1`` times more, each with the messages a round
    trip from stage ``i`` to the last waits on shared out over the ``stages - i``
    micro-batches 1F1B runs ahead on stage ``i`` (the most of any stage), and the slowest
    stage's gradient reductions (``crossed``: each cut's bytes, as ``crossing_bytes``)."""
    times = [sol.seconds - sol.sync for sol in solutions]
    stages, d = len(solutions), solutions[0].mesh.devices
    sends = [_sent(crossed[s], micro, (s * d, (s + 1) * d), cluster) for s in range(stages - 1)]
    steady = max(times) + max((sum(sends[i:]) / (stages - i) for i in range(stages - 1)),
                              default=0.0)
    return sum(times) + sum(sends) + (micro - 1) * steady + max(sol.sync for sol in solutions)


def _sent(crossed: tuple[int, int], micro: int, pair: tuple[int, int], cluster: Cluster
          ) -> float:
    """Seconds of what crosses a cut (``crossing_bytes``), both ways, per micro-batch."""
    return sum(cluster.collective("send", size / micro, [pair]) for size in crossed if size)


def crossing_bytes(graph: Graph, cut: int, needs_grad: set[PTensor]) -> tuple[int, int]:
    """What a stage boundary before op ``cut`` sends per whole batch: the bytes ops before
    it make and ops after it read, and those of their gradients sent back."""
    before = {t for op in graph.ops[:cut] for t in op.outputs}
    crossing = {t for op in graph.ops[cut:] for t in op.inputs if t in before}
    return (sum(nbytes(t) for t in crossing),
            sum(nbytes(t) for t in crossing if t in needs_grad))


class _Spaces:
    """The search space on each mesh for each micro-batch count, made once: the graph's
    one-device plan and batch dims are shared by all of them."""

    def __init__(self, graph: Graph, cluster: Cluster,
                 constraints: dict[str, str] | None = None, dtype: str = "fp32") -> None:
        self.graph, self.cluster, self.constraints = graph, cluster, constraints
        self.dtype = dtype
        self.whole = Plan(graph, 1)
        self.batch = _batch_sizes(graph, self.whole)
        self.made: dict[tuple[Mesh, int], tuple[dict[Op, list[Strategy]], dict[Op, Hashable]]] = {}

    def on(self, mesh: Mesh, micro: int
           ) -> tuple[dict[Op, list[Strategy]], dict[Op, Hashable]]:
        """The strategies over ``mesh`` of ops on ``1 / micro`` of the batch, and their
        groups of repeated ops."""
        if (mesh, micro) not in self.made:
            space = constrain(self.graph, strategies(self.graph, mesh, self.cluster,
                                                     whole=self.whole, dtype=self.dtype),
                              self.constraints) \
                if micro == 1 else _dividing(self.on(mesh, 1)[0], micro, self.batch)
            self.made[(mesh, micro)] = space, repeated(self.graph, space)
        return self.made[(mesh, micro)]


def on_micro_batches(graph: Graph, space: dict[Op, list[Strategy]], micro: int
                     ) -> dict[Op, list[Strategy]]:
    """The strategies that still divide an op's batch once it runs on ``1 / micro`` of it
    (cut into micro-batches as ``build_pipeline`` cuts it)."""
    return _dividing(space, micro, _batch_sizes(graph, Plan(graph, 1)))


def _batch_sizes(graph: Graph, whole: Plan) -> dict[Op, tuple[str, int]]:
    """Each op cut into micro-batches along a dim of its signature: that dim and its size
    (not loss tails: they are cut along values)."""
    batch_dim = batch_dims(graph)
    tails = loss_tails(graph, batch_dim, whole.registry)
    return {op: (dim, whole.roots[op.name].piece.sizes[dim]) for op in graph.ops
            if (dim := batch_dim[op]) is not None and op not in tails}


def _dividing(space: dict[Op, list[Strategy]], micro: int,
              batch: dict[Op, tuple[str, int]]) -> dict[Op, list[Strategy]]:
    kept: dict[tuple, list[Strategy]] = {}  # alike ops keep one list, as ``repeated`` needs
    out = {}
    for op, found in space.items():
        if op not in batch:
            out[op] = found
            continue
        dim, size = batch[op]
        key = (id(found), dim, size)
        if key not in kept:
            kept[key] = [s for s in found if size % (micro * _parts(s, dim)) == 0]
        out[op] = kept[key]
    return out


def _parts(s: Strategy, dim: str) -> int:
    return math.prod(a.parts for a in s.algos if isinstance(a, Split) and a.dim == dim)


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


def stage_bounds(seconds: Sequence[float], cuts: Sequence[int], stages: int,
                           sends: Mapping[int, float] | None = None) -> list[int]:
    """Stage bounds ``[0, c1, ..., len(seconds)]`` at ``cuts`` that minimise the slowest
    stage's total, with what it sends and receives at its cuts (``sends``: seconds per
    cut; a cut before a loss sends the logits), then the sum of squares, for balance."""
    sends = sends or {}
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
                t = before[points[j]] - before[points[i]] + sends.get(points[i], 0.0) + \
                    sends.get(points[j], 0.0)
                cand = (max(best[k - 1][i][0], t), best[k - 1][i][1] + t * t)
                if cand < best[k][j]:
                    best[k][j], back[k][j] = cand, i
    bounds, j = [len(seconds)], n - 1
    for k in range(stages, 0, -1):
        j = back[k][j]
        bounds.append(points[j])
    return bounds[::-1]
