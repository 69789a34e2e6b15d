"""Where parameters live: the regions a device stores, and the regions it updates.

A device *owns* the regions of a parameter whose update pieces it runs (see
``Plan.update``); it keeps their optimizer state and gradient. It *stores* the
regions its forward pieces read (refreshed from the owners after each step),
or with ``plan.param_storage == "owned"`` only what it owns, fetching the rest
from the owners when a piece reads it. A parameter whose update was left alone
is owned by every device that reads it, each updating its copy alike.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cache

from chronotope.errors import PlanError, UnassignedOpError
from chronotope.graph.ir import Op, TensorKind
from chronotope.graph.mask import Mask
from chronotope.plan.plan import Plan, PlanOp, placed

# Kinds of op whose outputs are always new tensors, never an input or a view of one: a
# gathered parameter that only such ops read may be freed once they ran, and autograd's
# saved copy of it filled again before their backward (ZeRO-3 resharding).
ALLOCATING = frozenset({
    "linear", "addmm", "matmul", "outer", "grouped_mm", "embedding", "conv", "conv_transpose",
    "layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "weight_norm",
    "attention", "add", "radd", "sub", "rsub", "mul", "div", "true_divide", "truediv",
    "addcmul", "addcdiv", "lerp", "where", "masked_fill", "cat", "stack", "clone",
})


def unit(op: Op) -> str | None:
    """What FSDP would wrap as one unit around an op (a piece of it that reads gathered
    parameters, a layer recomputed at once): its module up to the first numbered part of
    the path (one layer of a stack, ``h.3``), else its top-level module (``wte``); None
    for an op of no module."""
    source = op.source
    return _unit_of(source.module) if source is not None and source.module else None


@cache  # compile asks it of every piece of every rank's code
def _unit_of(module: str) -> str:
    parts = module.split(".")
    numbered = next((k for k, p in enumerate(parts) if p.isdigit()), 0)
    return ".".join(parts[:numbered + 1])


@dataclass(frozen=True)
class Owned:
    """One region a device updates, and the region of the gradient its update reads."""

    region: Mask
    grad: Mask


@dataclass
class Storage:
    stored: dict[int, dict[str, list[Mask]]]
    owned: dict[int, dict[str, list[Owned]]]

    def bytes_stored(self, plan: Plan, device: int) -> int:
        return sum(m.numel * plan.graph.params[p].dtype.itemsize
                   for p, ms in self.stored[device].items() for m in ms)

    def bytes_owned(self, plan: Plan, device: int, grads: bool = False) -> int:
        return sum((o.grad if grads else o.region).numel * plan.graph.params[p].dtype.itemsize
                   for p, os_ in self.owned[device].items() for o in os_)

    def bytes_updated(self, plan: Plan, device: int) -> int:
        """Bytes of the regions whose optimizer state one replica of ``device`` keeps:
        what it owns, a run of each region sharded over the replicas."""
        runs = self.replica_runs(plan, device)
        return sum(o.region.numel * plan.graph.params[p].dtype.itemsize
                   // (plan.replicas if (p, o.region.index) in runs else 1)
                   for p, os_ in self.owned[device].items() for o in os_)

    def replica_runs(self, plan: Plan, device: int) -> dict[tuple[str, tuple], int]:
        """With ``plan.shard_optimizer``: the regions ``device`` owns that its replicas
        update a run each of, and the dim of the runs. A region qualifies when it is one
        the device stores whole and updates from a gradient of just that region (the
        refresh then all-gathers it over the replicas), and a dim of it divides evenly."""
        if not plan.shard_optimizer:
            return {}
        out = {}
        for p, os_ in self.owned[device].items():
            for o in os_:
                dim = next((d for d, (a, b) in enumerate(o.region.index)
                            if (b - a) % plan.replicas == 0), None)
                if dim is not None and o.grad.index == o.region.index and \
                        Mask(o.region.index) in self.stored[device].get(p, ()):
                    out[(p, o.region.index)] = dim
        return out


def replica_run(index: tuple, dim: int, replica: int, replicas: int) -> tuple:
    """Run ``replica`` of ``replicas`` equal runs of region ``index`` along ``dim``."""
    a, b = index[dim]
    size = (b - a) // replicas
    return (*index[:dim], (a + replica * size, a + (replica + 1) * size), *index[dim + 1:])


def largest(masks: list[Mask]) -> list[Mask]:
    """The index regions among ``masks`` that no other one contains, in index order."""
    index_only = {Mask(m.index) for m in masks}
    return sorted((m for m in index_only if not any(o != m and o.contains(m) for o in index_only)),
                  key=lambda m: m.index)


def storage(plan: Plan, sequences: dict[int, list[PlanOp]]) -> Storage:
    reads: dict[int, dict[str, list[Mask]]] = {d: defaultdict(list) for d in sequences}
    for d, seq in sequences.items():
        for op in seq:
            for v in op.inputs:
                if v.ptensor.kind is TensorKind.PARAM:
                    reads[d][v.ptensor.name].append(v.mask)
    owned: dict[int, dict[str, list[Owned]]] = {d: defaultdict(list) for d in sequences}
    for name, root in plan.updates.items():
        for leaf in _update_leaves(plan, name, root):
            owned[placed(leaf)][name].append(Owned(leaf.outputs[0].mask, leaf.inputs[0].mask))
        for held in owned.values():
            if name in held:
                held[name] = _outermost(held[name])
    stored: dict[int, dict[str, list[Mask]]] = {d: {} for d in sequences}
    for d in sequences:
        for name in plan.graph.params:
            mine = [o.region for o in owned[d].get(name, ())]
            if name not in plan.updates:  # each device updates every region it stores
                regions = largest(reads[d].get(name, []))
            elif plan.param_storage == "owned":
                regions = largest(mine)
            else:
                regions = _disjoint(reads[d].get(name, []) + mine)
            if regions:
                stored[d][name] = regions
            if name not in plan.updates and name in reads[d] \
                    and plan.graph.params[name] in plan.grads:
                owned[d][name] = [Owned(r, r) for r in regions]
    first = min(sequences, default=None)
    for name, t in plan.graph.params.items():  # read by no piece: kept whole, as it is
        if first is not None and not any(name in stored[d] for d in sequences):
            stored[first][name] = [Mask.full(t.shape)]
    return Storage(stored, {d: dict(o) for d, o in owned.items()})


def _disjoint(masks: list[Mask]) -> list[Mask]:
    """The largest of ``masks``, with the box around any two that overlap in place of
    both: of two copies of the same values on one device only one is updated, and the
    other, refreshed from the other owners only, would keep stale values."""
    regions = largest(masks)
    while pair := next(((a, b) for i, a in enumerate(regions) for b in regions[i + 1:]
                        if a.overlaps(b)), None):
        a, b = pair
        box = Mask(tuple((min(x, y), max(u, w)) for (x, u), (y, w) in zip(a.index, b.index)))
        regions = largest([m for m in regions if m not in pair] + [box])
    return regions


def _outermost(owned: list[Owned]) -> list[Owned]:
    """One device's update pieces of a parameter, less those inside another of them: a
    region updated twice on one device (replicated update pieces) would take two steps."""
    regions = largest([o.region for o in owned])
    return [next(o for o in owned if o.region.index == r.index) for r in regions]


def _update_leaves(plan: Plan, name: str, root: PlanOp) -> list[PlanOp]:
    leaves = plan.leaves(root)
    unassigned = [leaf.name for leaf in leaves if leaf.device is None]
    if unassigned:
        raise UnassignedOpError(f"the update of parameter {name} has pieces on no device: "
                                f"{', '.join(unassigned)}; assign them with plan.assign")
    t = plan.graph.params[name]
    covered = largest([leaf.outputs[0].mask for leaf in leaves])
    if sum(m.numel for m in covered) != Mask.full(t.shape).numel:
        raise PlanError(f"the update pieces of parameter {name} do not cover all of it "
                        f"{list(t.shape)}; split the update so every region has an owner")
    return leaves
