"""Following one tensor axis through the graph by signatures.

A policy marks where an axis starts (the batch on inputs' axis 0, the
sequence on axis 1, a column-split linear's features); each op that reads a
marked axis names it with a signature dim, and that dim marks the output axes
it reaches. ``(b t)`` after a flatten keeps ``b`` as its leading factor, so the
batch survives reshapes; a reduced dim (``k+``) ends the trail, and so does an op
that reads the axis but cannot split it (no signature, or a frozen dim).
"""

from __future__ import annotations

from chronotope.graph.ir import Graph, Op, PTensor
from chronotope.graph.registry import OpRegistry

# Ops that take only the shape, dtype or device of their tensor inputs (``x.new_zeros``).
SHAPE_ONLY = frozenset({"fill", "factory"})


def carried_dim(op: Op, axis: dict[PTensor, int]) -> str | None:
    """The splittable signature dim of ``op`` that one of its inputs' marked axes carries."""
    sig = op.signature
    if sig is None:
        return None
    for t, tdims in zip(op.inputs, sig.inputs):
        a = axis.get(t)
        if a is None or a >= len(tdims):
            continue
        lead = tdims[a].factors[0]
        if lead.size is None and lead.name in sig.splittable():
            return lead.name
    return None


def carry(op: Op, dim: str, axis: dict[PTensor, int]) -> None:
    """Mark the output axes that ``dim`` (as a plain axis or a leading factor) reaches."""
    for t, tdims in zip(op.outputs, op.signature.outputs):
        for a, ax in enumerate(tdims):
            if ax.factors[0].name == dim:
                axis[t] = a
                break


def trail(graph: Graph, start: dict[PTensor, int]
          ) -> tuple[dict[Op, str | None], dict[Op, str]]:
    """For each op, the signature dim that carries the axes marked in ``start``; and the ops
    where the trail is lost without a reduction: they read a marked axis (of more than one
    element) but no splittable dim carries it, with why."""
    axis = dict(start)
    dims: dict[Op, str | None] = {}
    lost: dict[Op, str] = {}
    for op in graph.ops:
        dims[op] = carried_dim(op, axis)
        if dims[op] is not None:
            carry(op, dims[op], axis)
        elif op.kind not in SHAPE_ONLY and any(t in axis and t.shape[axis[t]] > 1
                                                for t in op.inputs):
            lost[op] = "no signature" if op.signature is None else \
                "its signature cannot split that dim"
    return dims, lost


def follow(graph: Graph, start: dict[PTensor, int]) -> dict[Op, str | None]:
    """For each op, the signature dim that carries the axes marked in ``start``."""
    return trail(graph, start)[0]


def batch_start(graph: Graph) -> dict[PTensor, int]:
    """Where the batch starts: axis 0 of every batch input."""
    return {t: 0 for t in graph.batched_inputs()}


def batch_dims(graph: Graph) -> dict[Op, str | None]:
    """For each op, the dim that carries the batch (axis 0 of every batch input)."""
    return follow(graph, batch_start(graph))


def sequence_dims(graph: Graph) -> dict[Op, str | None]:
    """For each op, the dim that carries the sequence (axis 1 of the batch inputs)."""
    return follow(graph, {t: 1 for t in graph.inputs if len(t.shape) >= 2})


def loss_tails(graph: Graph, batch_dim: dict[Op, str | None], registry: OpRegistry
               ) -> dict[Op, tuple[int, ...]]:
    """Ops without a batch dim that are linear in a batch reduction's partial sums (a mean
    loss's sum divided by its count, a learned weight times it), with the inputs they are
    linear in: cut along those values, one piece per micro-batch, the rest read whole. A
    smooth function of the sums that is not linear in them (``exp(mean)``) is no tail."""
    made_by = {t: op for op in graph.ops for t in op.outputs}
    tails: dict[Op, tuple[int, ...]] = {}
    for op in graph.ops:
        opdef = registry.of(op.target)
        if batch_dim[op] is not None or opdef is None:
            continue
        summed = {j for j, t in enumerate(op.inputs)
                  if (p := made_by.get(t)) is not None and (batch_dim[p] is not None or p in tails)}
        sets = [s for s in opdef.value_splits(len(op.inputs)) if summed & set(s)]
        if sets:  # what it is linear in, all of the sums where it can be
            tails[op] = next((s for s in sets if summed <= set(s)), sets[0])
    return tails
