"""Pipeline parallelism: stages, micro-batches and a schedule, all from the primitives.

``pipeline`` cuts the model into stages by parameter bytes and the batch into
micro-batches (``mesh`` does the placing); a schedule is the list of
``("F", m)`` / ``("B", m)`` steps of stage ``s``, and consecutive steps become
``plan.order`` calls between that stage's forward and backward micro-batch
groups. No schedule is known to the compiler or the runtime.

``actions`` reads a checked plan's per-device order back as
``torch.distributed.pipelining`` actions (``"1F0"``: stage 1, forward,
micro-batch 0), so orders compare step by step with torch's own schedules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chronotope.graph.ir import Graph
    from chronotope.plan import Plan

Step = tuple[str, int]


def gpipe(stage: int, stages: int, micro: int) -> list[Step]:
    """All forwards, then all backwards, in micro-batch order."""
    return [("F", m) for m in range(micro)] + [("B", m) for m in range(micro)]


def one_f_one_b(stage: int, stages: int, micro: int) -> list[Step]:
    """Warm up with the forwards the later stages need, then alternate one forward and one
    backward, then drain the backwards: at most ``stages - stage`` micro-batches live."""
    warmup = min(stages - stage - 1, micro)
    steps: list[Step] = [("F", m) for m in range(warmup)]
    for m in range(micro - warmup):
        steps += [("F", warmup + m), ("B", m)]
    return steps + [("B", m) for m in range(micro - warmup, micro)]


SCHEDULES: dict[str, Callable[[int, int, int], list[Step]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def pipeline(graph: Graph, stages: int, microbatches: int, schedule: str = "1f1b", *,
             dp: int = 1, tp: int = 1) -> Plan:
    """``stages`` pipeline stages (times ``tp`` tensor-parallel devices each, times ``dp``
    data-parallel groups) running ``microbatches`` micro-batches in ``schedule`` order."""
    from chronotope.policies.mesh import mesh

    return mesh(graph, dp, tp, pp=stages, micro=microbatches, schedule=schedule)


def actions(plan: Plan) -> dict[int, list[str]]:
    """Per rank, its stage's forward / backward micro-batch steps in the order it runs them,
    as torch pipelining action strings (``"0F1"``, ``"1B0"``); ranks without stages are
    left out. A run of pieces of one step is one action."""
    cells = plan.cells
    step_of = {}
    for (_, s, m), pieces in cells.items():
        for piece in pieces:
            for leaf in plan.leaves(piece):
                step_of[leaf] = f"{s}F{m}"
                back = plan.backward_op(leaf)
                if back is not None:
                    step_of[back] = f"{s}B{m}"
    checked = plan.check()
    out: dict[int, list[str]] = {}
    for rank in range(plan.ndevices):
        steps: list[str] = []
        for op in checked.sequence(rank):
            step = step_of.get(op)
            if step is not None and (not steps or steps[-1] != step):
                steps.append(step)
        if steps:
            out[rank] = steps
    return out
