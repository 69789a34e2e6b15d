"""Interlaced pipeline: a large shared embedding spread over all ranks, time-shared with 1F1B.

An encoder-decoder with one embedding table for its inputs and its output head
(T5) puts that table on the first and the last stage of a plain pipeline. Here
every op that reads the table runs on all ``stages`` ranks instead: the
lookups split along the model dim (rank k looks up columns k of every row),
the head along the vocabulary (rank k makes logits k), so each rank stores
about two ``1 / stages`` slices of the table. The other ops are cut into 1F1B
stages. Each rank's order interlaces the two: all lookups first, the head of
micro-batch m (with the loss, on the last rank) ahead of the rank's own
backward of m (how far is searched on the FLOP timeline), and the lookups'
backward last. All of it is ``op_trans``,
``op_assign`` and ``op_order``; the compiler derives the gathers in between.
"""

from __future__ import annotations

import math
from collections import defaultdict

from chronotope.compile.timeline import timeline
from chronotope.errors import DeadlockError, PlanError
from chronotope.graph.axes import batch_dims, loss_tails
from chronotope.graph.ir import Graph, Op, PTensor
from chronotope.plan import Plan, Split
from chronotope.plan.plan import PlanOp
from chronotope.policies.mesh import batch_cut, data_only
from chronotope.policies.mesh import stages as cut_stages
from chronotope.policies.pipeline import one_f_one_b


def shared_table(graph: Graph) -> tuple[PTensor, list[Op], int]:
    """The largest parameter read by several ops, the lookups that read it first, and
    the position where the head (its first other reader) starts."""
    readers: dict[PTensor, list[int]] = defaultdict(list)
    for i, op in enumerate(graph.ops):
        for t in op.inputs:
            if t in graph.params.values():
                readers[t].append(i)
    shared = [t for t, idx in readers.items() if len(set(idx)) > 1]
    if not shared:
        raise PlanError(f"{graph.name} has no parameter read by several ops: the interlaced "
                        "pipeline needs a shared embedding (inputs and output head)")
    table = max(shared, key=lambda t: math.prod(t.shape))
    lookups = [graph.ops[i] for i in readers[table] if graph.ops[i].kind == "embedding"]
    head = next((i for i in readers[table] if graph.ops[i].kind != "embedding"), None)
    if not lookups or head is None:
        raise PlanError(f"{table.name} is not both looked up and used as an output head: the "
                        "interlaced pipeline has nothing to time-share")
    return table, lookups, head


def interlaced(graph: Graph, stages: int, microbatches: int) -> Plan:
    """``stages`` ranks run 1F1B over the model without its shared embedding, and all of
    them run the embedding's lookups and head (see the module docstring). How far ahead
    of its backward each rank runs a head is searched: none, half or all of 1F1B's
    warmup depth, whichever the FLOP timeline finds shortest."""
    best: tuple[float, Plan] | None = None
    for lead in (2, 1, 0):  # halves of the warmup depth
        plan = _interlaced(graph, stages, microbatches, lead)
        try:
            makespan = timeline(plan).makespan
        except DeadlockError:
            if best is None and lead == 0:
                raise
            continue
        if best is None or makespan < best[0]:
            best = (makespan, plan)
    return best[1]


def _interlaced(graph: Graph, pp: int, micro: int, lead: int) -> Plan:
    table, lookups, head = shared_table(graph)
    batch = graph.batch_size
    if micro > 1 and batch % micro:
        raise PlanError(f"{micro} micro-batches need a batch divisible by {micro}; the example "
                        f"batch has {batch} samples")
    plan = Plan(graph, pp)
    tail = graph.ops[head:]  # the head and the loss after it
    core = [op for op in graph.ops if op not in lookups and op not in tail]
    stage = cut_stages(graph, pp, core)
    batch_dim = batch_dims(graph)
    tails = loss_tails(graph, batch_dim, plan.registry)
    data = data_only(graph)
    view = graph.ops[head]  # the head, or the table as it reads it: (v, d) -> (d, v)
    vocab = {view: _dim(view, view.inputs.index(table), 0)}
    for op in tail[1:] if view.kind == "transpose" else ():
        for j, t in enumerate(op.inputs):
            if t in view.outputs:  # the head itself: cut along the vocabulary too
                vocab[op] = _dim(op, j, 1)
    cells: dict[tuple[int, object, int], list[PlanOp]] = defaultdict(list)
    for op in graph.ops:
        batched = op not in data and (batch_dim[op] is not None or op in tails)
        micros = [plan.op(op.name)]
        if micro > 1 and batched:
            micros = plan.trans(op.name, batch_cut(op, batch_dim, tails, micro))
        for m, piece in enumerate(micros):
            if op in lookups or op in vocab:
                dim = _dim(op, 1 if op.kind == "embedding" else 0, 1) if op in lookups \
                    else vocab[op]
                for rank, part in enumerate(plan.trans(piece, Split(dim, pp))):
                    plan.assign(part, rank)
            else:
                plan.assign(piece, stage[op] if op in stage else pp - 1)
            if batched:
                where = "E" if op in lookups else "H" if op in tail else stage[op]
                cells[(0, where, m)].append(piece)
            elif op in vocab:  # the table's view, shared by every micro-batch's head
                cells[(0, "T", 0)].append(piece)
    plan.cells = dict(cells)  # stages, and "E" (lookups), "H" (head), "T" (the table's view)
    _order(plan, cells, pp, micro, lead)
    return plan


def _dim(op: Op, i: int, axis: int) -> str:
    return op.signature.inputs[i][axis].factors[0].name


def _order(plan: Plan, cells: dict, pp: int, micro: int, lead: int) -> None:
    """Each rank: every lookup, 1F1B with micro-batch m's head right before the backward
    of micro-batch ``m - ahead`` (``lead`` halves of the warmup depth; the last stage:
    right before m's own backward), then every lookup's backward."""
    def mine(key, rank):
        return [leaf for p in cells.get(key, ()) for leaf in plan.leaves(p)
                if leaf.device == rank]

    for r in range(pp):
        steps = []
        lookup = [plan.group(mine((0, "E", m), r), f"E.{m}") for m in range(micro)]
        lookup.append(plan.group(mine((0, "T", 0), r), "T"))
        heads = [plan.group(mine((0, "H", m), r), f"H.{m}") for m in range(micro)]
        steps += lookup
        ahead = (pp - 1 - r) * lead // 2  # in halves of 1F1B's warmup depth here
        for kind, s, m in one_f_one_b(r, pp, micro):
            group = plan.group(mine((0, s, m), r), f"F{s}.{m}")
            if kind == "B":  # the heads this rank's later steps wait for, first
                for h in range(m + ahead if m else 0, min(m + ahead, micro - 1) + 1):
                    steps += [heads[h], plan.backward(heads[h])]
            steps.append(group if kind == "F" else plan.backward(group))
        steps += [plan.backward(g) for g in lookup]
        steps = [s for s in steps if plan.leaves(s)]
        for before, after in zip(steps, steps[1:]):
            plan.order(before, after)
