"""Pipeline parallelism: stages, micro-batches and a schedule, all from the primitives.

``pipeline`` cuts the model into stages by parameter bytes and the batch into
micro-batches (``mesh`` does the placing; with ``chunks`` > 1 each rank holds
that many stages, ``r, r + ranks, ...``). A schedule is the list of
``("F" | "B", stage, micro-batch)`` steps of one rank, and consecutive steps
become ``plan.order`` calls between the rank's forward and backward
micro-batch groups. No schedule is known to the compiler or the runtime.

``actions`` reads a checked plan's per-device order back as
``torch.distributed.pipelining`` actions (``"1F0"``: stage 1, forward,
micro-batch 0), so orders compare step by step with torch's own schedules.
"""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from chronotope.errors import PlanError

if TYPE_CHECKING:
    from chronotope.graph.ir import Graph
    from chronotope.plan import Plan, PlanOp

Step = tuple[str, int, int]  # ("F" or "B", stage, micro-batch)


def gpipe(rank: int, ranks: int, micro: int, chunks: int = 1) -> list[Step]:
    """All forwards, then all backwards, in micro-batch order."""
    return [("F", rank, m) for m in range(micro)] + [("B", rank, m) for m in range(micro)]


def one_f_one_b(rank: int, ranks: int, micro: int, chunks: int = 1) -> list[Step]:
    """Warm up with the forwards the later stages need, then alternate one forward and one
    backward, then drain the backwards: at most ``ranks - rank`` micro-batches live."""
    warmup = min(ranks - rank - 1, micro)
    steps: list[Step] = [("F", rank, m) for m in range(warmup)]
    for m in range(micro - warmup):
        steps += [("F", rank, warmup + m), ("B", rank, m)]
    return steps + [("B", rank, m) for m in range(micro - warmup, micro)]


def interleaved(rank: int, ranks: int, micro: int, chunks: int) -> list[Step]:
    """Interleaved 1F1B (Megatron's virtual pipeline): rank ``r`` holds the ``chunks``
    stages ``r, r + ranks, ...``. Micro-batches pass through a rank's stages in rounds
    of ``ranks``, depth first; the warmup covers the other chunks of a round and two
    steps per rank still downstream, then one forward and one backward alternate."""
    rounds = max(1, micro // ranks)
    if micro % rounds:
        raise PlanError(f"interleaved 1F1B runs micro-batches in rounds of {micro // rounds}: "
                        f"{micro} micro-batches on {ranks} stages do not make whole rounds")
    per_round = micro // rounds
    total = chunks * micro
    warmup = min((chunks - 1) * per_round + 2 * (ranks - 1 - rank), total)
    done: dict[tuple[str, int], int] = defaultdict(int)
    steps: list[Step] = []

    def step(kind: str, chunk: int) -> None:
        stage = chunk * ranks + rank
        steps.append((kind, stage, done[(kind, stage)]))
        done[(kind, stage)] += 1

    for i in range(total + warmup):
        if i < total:
            step("F", i // per_round % chunks)
        if i >= warmup:
            step("B", chunks - 1 - (i - warmup) // per_round % chunks)
    return steps


Schedule = Callable[[int, int, int, int], list[Step]]  # (rank, ranks, micro, chunks) -> steps

SCHEDULES: dict[str, Schedule] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
}
MULTI_STAGE = {"interleaved"}  # schedules for ranks holding several stages (chunks)


_ACTION = re.compile(r"(\d+)([A-Z_]+)(\d*)")
# Actions torch lists that are communication or gradient reduction: the compiler's own.
_DERIVED = {"REDUCE_GRAD", "UNSHARD", "RESHARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}


def read_schedule(path: str) -> tuple[Schedule, dict[int, list[Step]]]:
    """A schedule from torch pipelining's CSV: one row per rank of compute actions
    (``0F1``: stage 0, forward, micro-batch 1; ``1B0``: a backward). Empty cells are idle
    steps; gradient reductions and communication are the compiler's, so they are skipped.
    Returns the schedule and its steps per rank."""
    rows: dict[int, list[Step]] = {}
    with open(path, newline="") as f:
        for rank, row in enumerate(csv.reader(f)):
            rows[rank] = []
            for cell in (c.strip() for c in row):
                if not cell:
                    continue
                found = _ACTION.fullmatch(cell)
                kind = found.group(2) if found else None
                if kind in _DERIVED:
                    continue
                if kind in ("F", "B") and found.group(3):
                    rows[rank].append((kind, int(found.group(1)), int(found.group(3))))
                elif kind in ("I", "W"):
                    raise PlanError(f"{path}: rank {rank}: {cell} splits the backward into "
                                    "input and weight parts, which this schedule reader does "
                                    "not take yet; write B for the whole backward")
                else:
                    raise PlanError(f"{path}: rank {rank}: cannot read action {cell!r}; "
                                    "expected a stage, F or B, and a micro-batch, like 0F1")
    if not rows:
        raise PlanError(f"{path}: no ranks in this schedule file")

    def schedule(rank: int, ranks: int, micro: int, chunks: int) -> list[Step]:
        if ranks != len(rows):
            raise PlanError(f"{path} has {len(rows)} ranks, the pipeline {ranks}")
        return rows[rank]
    return schedule, rows


def pipeline(graph: Graph, stages: int, microbatches: int, schedule: str | Schedule = "1f1b", *,
             dp: int = 1, tp: int = 1, chunks: int = 1, recompute: str | None = None,
             swap: str | None = None) -> Plan:
    """``stages`` pipeline ranks (times ``tp`` tensor-parallel devices each, times ``dp``
    data-parallel groups) running ``microbatches`` micro-batches in ``schedule`` order;
    with ``chunks`` > 1 (interleaved), each rank holds that many stages; ``recompute``
    and ``swap`` as in ``mesh``."""
    from chronotope.policies.mesh import mesh

    return mesh(graph, dp, tp, pp=stages, micro=microbatches, schedule=schedule,
                chunks=chunks, recompute=recompute, swap=swap)


def step_of(plan: Plan) -> dict[PlanOp, str]:
    """Each forward and backward piece a pipeline policy placed, as its action string."""
    out = {}
    for (_, s, m), pieces in plan.cells.items():
        for piece in pieces:
            for leaf in plan.leaves(piece):
                out[leaf] = f"{s}F{m}"
                back = plan.backward_op(leaf)
                if back is not None:
                    out[back] = f"{s}B{m}"
    return out


def actions(plan: Plan) -> dict[int, list[str]]:
    """Per rank, its stage's forward / backward micro-batch steps in the order it runs them,
    as torch pipelining action strings (``"0F1"``, ``"1B0"``); ranks without stages are
    left out. A run of pieces of one step is one action."""
    steps_of = step_of(plan)
    checked = plan.check()
    out: dict[int, list[str]] = {}
    for rank in range(plan.ndevices):
        steps: list[str] = []
        for op in checked.sequence(rank):
            step = steps_of.get(op)
            if step is not None and (not steps or steps[-1] != step):
                steps.append(step)
        if steps:
            out[rank] = steps
    return out
