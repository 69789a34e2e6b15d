"""From per-op decisions to a plan, written with the primitives like any other plan.

A device mesh is a tuple of axis sizes (``(nodes, per_node)``, ``(2, 2, 2)``), devices
numbered row-major. An op's decision is one algorithm per axis: the op is cut by the
first over axis 0, each piece by the second over axis 1, and so on; the pieces, in
that order, go to devices 0, 1, ... Weights named in ``zero`` have their updates cut
over all devices, as ZeRO-2 does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from chronotope.graph.ir import Graph, Op
from chronotope.plan.algo import Algorithm
from chronotope.plan.plan import Plan
from chronotope.policies.zero import cut_update


def build(graph: Graph, mesh: Sequence[int], choice: Mapping[Op, Sequence[Algorithm]],
          zero: Iterable[str] = ()) -> Plan:
    """The plan of ``choice`` over ``mesh``; an op without a decision runs on device 0."""
    devices = math.prod(mesh)
    plan = Plan(graph, devices)
    for op in graph.ops:
        algos = choice.get(op)
        if devices == 1 or not algos:
            plan.assign(op.name, 0)
            continue
        pieces = [plan.op(op.name)]
        for algo in algos:
            pieces = [sub for piece in pieces for sub in plan.trans(piece, algo)]
        for device, piece in enumerate(pieces):
            plan.assign(piece, device)
    for name in zero:
        cut_update(plan, name)
    return plan
