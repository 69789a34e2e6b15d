"""The data-parallel dimension ``plan.scale`` adds, and what it asks of the graph.

Replica ``r`` of a scaled plan runs the unit plan on its own rows of the global
batch (rows ``r * b`` to ``(r + 1) * b`` for a unit batch of ``b``). On a replica
every tensor is then *batched* (its samples' rows), *whole* (the same on every
replica: weights, what never sees the batch) or *partial* (its addend of a sum over
the replicas: a loss, a count of labels). The replicas train like one device on the
global batch, with the loss and every gradient summed over them, when

- an op that sums over the batch makes a partial; one that takes a mean makes the
  replica's share of the global mean (its output times ``1 / R``);
- only the loss's tails (ops linear in what sums over the batch) read a partial that
  takes a gradient, and each takes a ``1 / R`` share of the whole values it adds to
  it (a weight penalty added to a mean loss);
- a partial that takes no gradient (the count a token-mean loss divides by) is summed
  over the replicas once made, so that what reads it reads the whole.

What would read across replicas otherwise (batch statistics that take a gradient, an
op that reads the whole batch, random numbers drawn per sample, a loss that does not
sum over samples) is refused, naming the op: ``ct.policies.mesh(graph, dp=...)``
writes the data-parallel dimension into the plan instead, and derives what such ops
need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch

from chronotope.errors import PlanError
from chronotope.graph.axes import SHAPE_ONLY, batch_start, carried_dim, carry, loss_tails, trail
from chronotope.graph.convert import is_random
from chronotope.graph.ir import Graph, Op, PTensor
from chronotope.graph.registry import OpRegistry, iter_leaves


@dataclass(frozen=True)
class Replicas:
    """How a unit plan's code changes to run as one of ``count`` data-parallel replicas."""

    count: int
    unit: int  # devices per replica: replica r's device d is global rank r * unit + d
    means: frozenset[Op] = frozenset()  # means over the batch: outputs times 1 / count
    shares: dict[Op, frozenset[int]] = field(default_factory=dict)  # tails' whole inputs
    summed: frozenset[PTensor] = frozenset()  # partials without gradient: summed once made

    @property
    def share(self) -> Fraction:
        return Fraction(1, self.count)

    def group(self, device: int) -> tuple[int, ...]:
        """The global ranks that run unit device ``device``: its replicas."""
        return tuple(device + r * self.unit for r in range(self.count))


def replicas(graph: Graph, registry: OpRegistry, requires_grad: set[PTensor], count: int,
             unit: int) -> Replicas:
    """What ``count`` replicas of a unit plan of ``unit`` devices over ``graph`` need, or a
    PlanError naming the first op that would read across them."""
    axis = batch_start(graph)  # tensor -> its batch axis (batched tensors)
    tails = loss_tails(graph, trail(graph, batch_start(graph))[0], registry)
    partial: set[PTensor] = set()
    means, shares, summed = set(), {}, set()
    for op in graph.ops:
        dim = carried_dim(op, axis)
        opdef = registry.of(op.target)
        for j, t in enumerate(op.inputs):
            if t in partial and not (op in tails and j in tails[op]):
                _refuse(op, f"it needs the whole of {t.name}, a sum over the batch that takes "
                        "a gradient (batch statistics): each replica holds only its part")
            if t in axis and not _carries(op, j, axis[t], dim) and op.kind not in SHAPE_ONLY:
                _refuse(op, f"it reads {t.name} along the batch, which no dim of its "
                        "signature carries: it needs every replica's rows")
        if op in tails:
            shares[op] = frozenset(j for j in tails[op] if op.inputs[j] not in partial)
            partial.update(op.outputs)
        elif dim is not None and op.signature is not None:  # (a carried dim has a signature)
            if is_random(op):
                _refuse(op, "it draws random numbers per sample, and a replica cannot tell "
                        "which rows of the global batch it holds")
            carry(op, dim, axis)
            if op.signature.dim(dim).reduce:
                partial.update(op.outputs)
                if opdef is not None and opdef.averages(op.args, op.kwargs):
                    means.add(op)
            elif any(t not in axis for t in op.outputs):
                _refuse(op, "it makes a tensor without the batch axis from batched inputs")
        for t in op.outputs:
            if t in partial and t not in requires_grad:
                partial.discard(t)  # summed over the replicas: whole from here on
                summed.add(t)
    loss = graph.loss
    if loss not in partial:
        why = "it holds the batch's rows" if loss in axis else "it does not depend on the batch"
        raise PlanError(f"plan.scale needs a loss that sums or averages over samples; "
                        f"{loss.name}: {why}. Use ct.policies.mesh(graph, dp=...) instead")
    for name, t in graph.buffer_updates.items():
        if t in axis:
            raise PlanError(f"plan.scale: buffer {name} is updated with the batch's rows; "
                            "use ct.policies.mesh(graph, dp=...) instead")
    return Replicas(count, unit, frozenset(means), shares, frozenset(summed))


def same_but_batch(unit: Graph, whole: Graph, count: int) -> None:
    """Refuse to run replicas of ``unit`` (a graph of one replica's rows) for a batch whose
    own graph ``whole`` is not the same op for op, with only one axis of its tensors
    ``count`` times longer: a number taken from the batch's size when the graph was
    captured (a mean written ``x.sum() / x.shape[0]``) would make each replica count its
    own rows as the whole batch."""
    def refuse(op: Op, why: str) -> None:
        where = f" at {op.source}" if op.source else ""
        raise PlanError(f"plan.scale: op {op.name} ({op.kind}{where}) {why} on the whole "
                        f"batch of {count} replicas than on one replica's rows: its graph "
                        "depends on the batch's size, so replicas cannot run one replica's "
                        "code. Use ct.policies.mesh(graph, dp=...) on the whole batch's graph")

    if len(unit.ops) != len(whole.ops):
        raise PlanError(f"plan.scale: the whole batch's graph has {len(whole.ops)} ops, one "
                        f"replica's {len(unit.ops)}: the model runs other ops for another "
                        "batch size. Use ct.policies.mesh(graph, dp=...) instead")
    for a, b in zip(unit.ops, whole.ops):
        if a.target != b.target:
            refuse(a, f"calls {b.target} instead")
        mine, theirs = _constants(a), _constants(b)
        if a.kind not in ("reshape", "expand", "fill") and mine != theirs:
            refuse(a, f"takes other arguments ({theirs} instead of {mine})")
        for t, u in zip(a.outputs, b.outputs):
            longer = [i for i, (x, y) in enumerate(zip(t.shape, u.shape)) if x != y]
            if len(t.shape) != len(u.shape) or len(longer) > 1 or any(
                    u.shape[i] != count * t.shape[i] for i in longer):
                refuse(a, f"makes {tuple(u.shape)} instead of {tuple(t.shape)}")
    for name, value in unit.constants.items():
        other = whole.constants.get(name)
        if other is None or other.shape != value.shape or not torch.equal(other, value):
            raise PlanError(f"plan.scale: constant {name} differs on the whole batch from one "
                            "replica's: the model builds it from the batch's size. Use "
                            "ct.policies.mesh(graph, dp=...) instead")


def _constants(op: Op) -> list:
    """The call's arguments that are no tensors, in order."""
    return [x for x in iter_leaves((op.args, op.kwargs)) if not isinstance(x, PTensor)]


def _carries(op: Op, j: int, a: int, dim: str | None) -> bool:
    """Whether input ``j``'s batch axis ``a`` is signature dim ``dim`` (its leading factor)."""
    if dim is None or op.signature is None or a >= len(op.signature.inputs[j]):
        return False
    return op.signature.inputs[j][a].factors[0].name == dim


def _refuse(op: Op, why: str) -> None:
    where = f" at {op.source}" if op.source else ""
    raise PlanError(f"plan.scale cannot run op {op.name} ({op.kind}{where}) on each replica "
                    f"alone: {why}. Use ct.policies.mesh(graph, dp=...) to write the "
                    "data-parallel dimension into the plan, which derives what the op needs")
