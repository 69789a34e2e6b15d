"""From per-op decisions to a plan, written with the primitives like any other plan.

A device mesh is a tuple of axis sizes (``(nodes, per_node)``, ``(2, 2, 2)``), devices
numbered row-major. An op's decision is one algorithm per axis: the op is cut by the
first over axis 0, each piece by the second over axis 1, and so on; the pieces, in
that order, go to the mesh's devices 0, 1, ... Weights named in ``zero`` have their
updates cut over all devices, as ZeRO-2 does. A pipeline puts each stage's ops on its
own devices, cuts the batched ones into micro-batches, places every micro-batch's
piece as its op's decision says, and orders the stage's steps by the schedule.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from chronotope.graph.axes import batch_start, loss_tails, trail
from chronotope.graph.ir import Graph, Op
from chronotope.plan.algo import Algorithm
from chronotope.plan.plan import Plan, PlanOp
from chronotope.policies.mesh import (
    _placement,
    _refuse_barriers,
    _schedule,
    batch_cut,
    data_only,
)
from chronotope.policies.pipeline import SCHEDULES
from chronotope.policies.zero import cut_update


def build(graph: Graph, mesh: Sequence[int], choice: Mapping[Op, Sequence[Algorithm]],
          zero: Iterable[str] = ()) -> Plan:
    """The plan of ``choice`` over ``mesh``; an op without a decision runs on device 0."""
    plan = Plan(graph, math.prod(mesh))
    for op in graph.ops:
        place(plan, plan.op(op.name), choice.get(op, ()), 0)
    for name in zero:
        cut_update(plan, name)
    return plan


def build_pipeline(graph: Graph, stage_devices: int, stage_of: Mapping[Op, int], micro: int,
                   choice: Mapping[Op, Sequence[Algorithm]], schedule: str = "1f1b",
                   zero: Iterable[str] = ()) -> Plan:
    """Stages of ``stage_devices`` devices each (stage ``s`` on the rank its schedule
    gives it), ``micro`` micro-batches, each op's pieces cut as ``choice`` says."""
    stages = max(stage_of.values()) + 1
    plan = Plan(graph, stages * stage_devices)
    batch_dim, unsplit = trail(graph, batch_start(graph))
    tails, data = loss_tails(graph, batch_dim, plan.registry), data_only(graph)
    orders = {r: SCHEDULES[schedule](r, stages, micro, 1) for r in range(stages)} \
        if stages > 1 and micro > 1 else {}
    if micro > 1:
        plan.unsplit = unsplit
    if orders:
        _refuse_barriers(graph, batch_dim, tails, data, schedule, micro)
    rank_of = _placement(orders, stages, 1)
    cells: dict[tuple[int, int, int], list[PlanOp]] = defaultdict(list)
    for op in graph.ops:
        stage = stage_of[op]
        batched = op not in data and (batch_dim[op] is not None or op in tails)
        micros = plan.trans(op.name, batch_cut(op, batch_dim, tails, micro)) \
            if micro > 1 and batched else [plan.op(op.name)]
        for m, piece in enumerate(micros):
            place(plan, piece, choice.get(op, ()), rank_of[stage] * stage_devices)
            if orders and batched:
                cells[(0, stage, m)].append(piece)
    plan.cells = dict(cells)
    if orders:
        _schedule(plan, cells, 1, micro, orders, rank_of)
    for name in zero:  # over the devices of the stage that reads the weight
        param = graph.params[name]
        first = rank_of[stage_of[next(op for op in graph.ops if param in op.inputs)]]
        cut_update(plan, name, devices=range(first * stage_devices,
                                             (first + 1) * stage_devices))
    return plan


def place(plan: Plan, piece: PlanOp, algos: Sequence[Algorithm], first: int) -> None:
    """Cut ``piece`` by ``algos`` (one per mesh axis, nested) onto devices ``first``, ..."""
    pieces = [piece]
    for algo in algos:
        pieces = [sub for p in pieces for sub in plan.trans(p, algo)]
    for k, sub in enumerate(pieces):
        plan.assign(sub, first + k)
