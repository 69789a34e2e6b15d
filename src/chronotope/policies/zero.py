"""ZeRO (stages 1-3) from the primitives: data parallel, with each parameter's update split.

The forward and backward are data parallel; the update of every parameter is
cut into one piece per device (along its first dim that divides), so each
device keeps the optimizer state of 1/n of the weights.

* stage 1: each update piece reads the whole gradient (an all-reduce), then
  takes its region; every device stores all weights, refreshed from the owners
  after the step.
* stage 2: each update piece reads only its region of the gradient, so the
  compiler sums just that region on its owner (a reduce-scatter).
* stage 3: as stage 2, and a device stores only the weights it owns; the
  others are fetched from their owners when a piece reads them, and (``reshard``, as
  FSDP2's default) freed after their forward and fetched again for their backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from chronotope.errors import PlanError
from chronotope.graph.ir import Graph
from chronotope.plan import Plan, Replicate, Split
from chronotope.policies.mesh import data_parallel


def zero(graph: Graph, ndevices: int, stage: int = 1, reshard: bool = True) -> Plan:
    if stage not in (1, 2, 3):
        raise PlanError(f"ZeRO has stages 1, 2 and 3, got stage={stage}")
    plan = data_parallel(graph, ndevices)
    for name, t in graph.params.items():
        if t in plan.requires_grad:
            cut_update(plan, name, whole_grad=stage == 1)
    if stage == 3:
        plan.param_storage = "owned"
        plan.reshard = reshard
    return plan


def cut_update(plan: Plan, param: str, *, whole_grad: bool = False,
               devices: Sequence[int] | None = None) -> None:
    """Cut ``param``'s update into one piece per device of ``devices`` (default: all),
    along its first dim that divides, so each keeps its share of the optimizer state."""
    devices = range(plan.ndevices) if devices is None else devices
    t, n = plan.graph.params[param], len(devices)
    axis = next((a for a, size in enumerate(t.shape) if size % n == 0), None)
    algo = Split(f"d{axis}", n) if axis is not None else Replicate(n)
    for device, piece in zip(devices, plan.trans(plan.update(param, whole_grad=whole_grad), algo)):
        plan.assign(piece, device)
