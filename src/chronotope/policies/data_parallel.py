"""Data parallelism written with the primitives: every op split along the batch.

The batch dim is followed through the graph by signatures: batch inputs carry
it on axis 0, and each op passes it from the input axis it arrives on to the
output axes named by the same signature dim (``(b t)`` after a flatten keeps
``b`` as its leading factor). Ops that never see the batch are replicated.
"""

from __future__ import annotations

from chronotope.errors import PlanError
from chronotope.graph.ir import Graph, Op, PTensor
from chronotope.plan import Plan, Replicate, Split


def batch_dims(graph: Graph) -> dict[Op, str | None]:
    """For each op, the signature dim that carries the batch (None when it has none)."""
    axis: dict[PTensor, int] = {t: 0 for t in graph.inputs if t.shape}
    dims: dict[Op, str | None] = {}
    for op in graph.ops:
        dims[op] = None
        sig = op.signature
        if sig is None:
            continue
        for t, tdims in zip(op.inputs, sig.inputs):
            a = axis.get(t)
            if a is None or a >= len(tdims):
                continue
            lead = tdims[a].factors[0]
            if lead.size is None and lead.name in sig.splittable():
                dims[op] = lead.name
                break
        if dims[op] is None:
            continue
        for t, tdims in zip(op.outputs, sig.outputs):
            for a, ax in enumerate(tdims):
                if ax.factors[0].name == dims[op]:
                    axis[t] = a
                    break
    return dims


def data_parallel(graph: Graph, ndevices: int) -> Plan:
    """Each device runs 1/ndevices of the batch with a full copy of the weights."""
    batch = graph.inputs[0].shape[0] if graph.inputs and graph.inputs[0].shape else 0
    if ndevices < 1 or batch % ndevices:
        raise PlanError(f"data parallel over {ndevices} devices needs a batch divisible by "
                        f"{ndevices}; the example batch has {batch} samples")
    plan = Plan(graph, ndevices)
    for op, dim in batch_dims(graph).items():
        algo = Split(dim, ndevices) if dim is not None else Replicate(ndevices)
        for device, piece in enumerate(plan.trans(op, algo)):
            plan.assign(piece, device)
    return plan
