"""ZeRO (stages 1-3) from the primitives: data parallel, with each parameter's update split.

The forward and backward are data parallel (with ``tp`` > 1, each group of ``tp`` devices
tensor parallel, as ``policies.mesh`` cuts it); the update of every region of a parameter
is cut into one piece per device that reads the region (along its first dim that
divides), so each device keeps the optimizer state of its share of the weights it reads.

* stage 1: each update piece reads the whole gradient (an all-reduce), then
  takes its region; every device stores all weights, refreshed from the owners
  after the step.
* stage 2: each update piece reads only its region of the gradient, so the
  compiler sums just that region on its owner (a reduce-scatter).
* stage 3: as stage 2, and a device stores only the weights it owns; the
  others are fetched from their owners when a piece reads them, and (``reshard``, as
  FSDP2's default) freed after their forward and fetched again for their backward.
  With tensor parallelism (FSDP with TP) a device fetches its shard's runs from the
  replicas of its shard only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from chronotope.errors import PlanError
from chronotope.graph.ir import Graph, TensorKind
from chronotope.plan import Plan, PlanOp, Replicate, Split
from chronotope.policies.mesh import data_parallel, mesh


def zero(graph: Graph, ndevices: int, stage: int = 1, reshard: bool = True,
         tp: int = 1) -> Plan:
    if stage not in (1, 2, 3):
        raise PlanError(f"ZeRO has stages 1, 2 and 3, got stage={stage}")
    if tp < 1 or ndevices % tp:
        raise PlanError(f"ZeRO over {ndevices} devices needs a tensor-parallel degree that "
                        f"divides them, got tp={tp}")
    plan = data_parallel(graph, ndevices) if tp == 1 else mesh(graph, ndevices // tp, tp)
    cut_updates(plan, whole_grad=stage == 1)
    if stage == 3:
        plan.param_storage = "owned"
        plan.reshard = reshard
    return plan


def cut_update(plan: Plan, param: str, *, whole_grad: bool = False,
               devices: Sequence[int] | None = None) -> None:
    """Cut ``param``'s update into one piece per device of ``devices`` (default: all),
    along its first dim that divides, so each keeps its share of the optimizer state."""
    devices = range(plan.ndevices) if devices is None else devices
    _cut(plan, plan.update(param, whole_grad=whole_grad),
         plan.graph.params[param].shape, devices)


def cut_updates(plan: Plan, *, whole_grad: bool = False) -> None:
    """Cut the update of every trainable parameter region by region: where the devices'
    pieces read it in equal runs along one dim (a tensor-parallel shard each), each run's
    update over the devices that read that run; else the whole update over every device
    that reads any of it."""
    read: dict[str, dict[tuple, set[int]]] = defaultdict(lambda: defaultdict(set))
    for piece in plan.forward_leaves():
        for v in piece.inputs:
            t = v.ptensor
            if t.kind is TensorKind.PARAM and t in plan.requires_grad and \
                    piece.device is not None:
                read[t.name][v.mask.index].add(piece.device)
    for name, t in plan.graph.params.items():
        if t not in plan.requires_grad:
            continue
        regions = read.get(name, {})
        dim = _runs(sorted(regions), t.shape)
        if dim is None:  # read whole, overlapping or by no piece: over every reader
            cut_update(plan, name, whole_grad=whole_grad, devices=sorted(
                {d for devices in regions.values() for d in devices}) or None)
            continue
        pieces = plan.trans(plan.update(name, whole_grad=whole_grad),
                            Split(f"d{dim}", len(regions)))
        for piece, index in zip(pieces, sorted(regions)):
            shape = tuple(b - a for a, b in index)
            _cut(plan, piece, shape, sorted(regions[index]), first=dim)


def _runs(regions: list[tuple], shape: tuple[int, ...]) -> int | None:
    """The dim along which ``regions`` (sorted) are the equal runs of a whole tensor of
    ``shape``, in order; None where they are not (or are one region)."""
    if len(regions) < 2:
        return None
    for dim, size in enumerate(shape):
        if size % len(regions):
            continue
        step = size // len(regions)
        if all(r[d] == ((k * step, (k + 1) * step) if d == dim else (0, shape[d]))
               for k, r in enumerate(regions) for d in range(len(shape))):
            return dim
    return None


def _cut(plan: Plan, piece: PlanOp, shape: tuple[int, ...], devices: Sequence[int],
         first: int | None = None) -> None:
    """``piece`` (an update of a region of ``shape``) cut into one piece per device, along
    its first dim that divides (``first``: that dim if it divides), else replicated."""
    n = len(devices)
    order = ([first] if first is not None else []) + list(range(len(shape)))
    axis = next((a for a in order if shape[a] % n == 0), None)
    algo = Split(f"d{axis}", n) if axis is not None else Replicate(n)
    for device, sub in zip(devices, plan.trans(piece, algo)):
        plan.assign(sub, device)
