"""Intra-op search as an integer linear program (Alpa's formulation), solved by HiGHS.

One binary per op and strategy, exactly one chosen per op; one continuous variable per
producer-consumer edge and pair of strategies, equal to the product of the two choices
(its rows sum to the producer's choice, its columns to the consumer's), priced by the
layout changes the pair needs forward (the tensor) and backward (its gradient). The
objective adds each op's compute and the gradient all-reduce of every weight it
reads whole while cutting its batch; per-device memory (weights, gradients, optimizer
state, activations) is bounded by the limit. A weight read by two ops (tied embeddings)
is read by both in one layout: their gradients then add up where they are made and are
reduced once, as the compiler sums them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from chronotope.compile.rvd import PARTIAL, REPLICATE
from chronotope.compile.simulate import OPTIMIZER_PASSES
from chronotope.cost.network import Cluster
from chronotope.graph.ir import Graph, Op, PTensor, TensorKind
from chronotope.plan.check import optimizer_states
from chronotope.plan.plan import differentiable
from chronotope.search.space import (
    Mesh,
    Placements,
    Pricer,
    Strategy,
    nbytes,
    sharded,
)


@dataclass
class Solution:
    choice: dict[Op, Strategy]
    seconds: float  # the objective: predicted step time, before overlap
    memory: float  # the model's per-device bytes of the choice
    variables: int
    status: str
    mesh: Mesh
    sync: float = 0.0  # of ``seconds``, what runs once a step: gradient reductions, update
    held: float = 0.0  # of ``memory``, one in-flight micro-batch's activations


class NoFit(Exception):
    """No choice fits the memory limit; carries the smallest memory any choice needs."""

    def __init__(self, least: float) -> None:
        super().__init__(least)
        self.least = least


def solve(graph: Graph, space: dict[Op, list[Strategy]], mesh: Mesh | int, cluster: Cluster,
          memory: float | None, optimizer: str | float = "adam", time_limit: float = 60.0,
          groups: dict[Op, Hashable] | None = None, ops: Sequence[Op] | None = None,
          micro: int = 1, in_flight: int = 1, gap: float = 0.01) -> Solution:
    """The cheapest choice within ``memory``; ops in one of ``groups`` (repeated layers'
    ops, ``space.repeated``) share one decision, so the program grows with the distinct
    ops, not with depth. ``ops``: decide only these (a pipeline stage's), the rest absent.

    ``micro``: the ops run on micro-batches of 1/micro of the batch, and the objective is
    one micro-batch's time plus the step's gradient reductions; ``in_flight`` micro-batches'
    activations are held at once (a pipeline stage's). ``gap``: stop within this fraction of
    the optimum (the cost model is no finer than that)."""
    mesh = Mesh((mesh,)) if isinstance(mesh, int) else mesh
    pricer = Pricer(mesh, cluster)
    ops = [op for op in (graph.ops if ops is None else ops) if space[op]]
    key = {op: (groups or {}).get(op, op) for op in ops}
    members: dict[Hashable, list[Op]] = {}
    for op in ops:
        members.setdefault(key[op], []).append(op)
    sizes = {k: len(space[g[0]]) for k, g in members.items()}
    start, count = {}, 0
    for k in members:
        start[k] = count
        count += sizes[k]
    needs_grad = differentiable(graph)
    costs, mem, passing = np.zeros(count), np.zeros(count), np.zeros(count)
    states = 2 + optimizer_states(optimizer)  # the weight, its gradient, its state
    first = first_reads(ops)
    terms: dict[tuple, np.ndarray] = {}  # a repeated op's, once
    for op in ops:
        at, n = start[key[op]], sizes[key[op]]
        alike = (key[op], tuple(first[op]),
                 tuple(t in needs_grad for t in (*op.inputs, *op.outputs)))
        if alike not in terms:
            terms[alike] = np.array([
                (strat.compute / micro + _op_sync(op, strat, first[op], pricer),
                 _weight_bytes(op, strat, first[op], states, mesh) +
                 _output_bytes(op, strat, mesh) * in_flight / micro,
                 _gradient_bytes(op, strat, mesh, needs_grad) / micro)
                for strat in space[op]]).reshape(n, 3)
        term = terms[alike]
        costs[at:at + n] += term[:, 0]
        mem[at:at + n] += term[:, 1]
        passing[at:at + n] = np.maximum(passing[at:at + n], term[:, 2])
    edges: dict[tuple[Hashable, Hashable], np.ndarray] = {}  # summed over repeated edges
    edge_mem: dict[tuple[Hashable, Hashable], np.ndarray] = {}
    chosen = set(ops)
    tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # a repeated edge's, once
    for op in ops:
        for i, t in enumerate(op.inputs):
            producer = t.producer
            if producer not in chosen:
                continue
            out = producer.outputs.index(t)
            pair = (key[producer], key[op])
            alike = (pair, out, i, t in needs_grad)
            if alike not in tables:
                tables[alike] = _edge_tables(space[producer], space[op], out, i, t, pricer,
                                             needs_grad, micro, in_flight)
            table, held = tables[alike]
            edges[pair] = edges[pair] + table if pair in edges else table
            edge_mem[pair] = edge_mem[pair] + held if pair in edge_mem else held
    forbidden: dict[tuple[Hashable, Hashable], np.ndarray] = {}
    for op, i, reader, j in later_reads(ops):  # a weight read again: the same layout
        pair = (key[reader], key[op])
        if pair[0] == pair[1]:
            continue  # one decision: one layout
        table, apart = _shared_tables(space[reader], space[op], j, i, reader.inputs[j], pricer)
        edges[pair] = edges[pair] + table if pair in edges else table
        forbidden[pair] = forbidden[pair] | apart if pair in forbidden else apart
    # one more variable: the largest gradients an op's backward holds at once, on top of
    # what is kept for backward (at least each chosen op's)
    total = count + sum(t.size for t in edges.values()) + 1
    c = np.zeros(total)
    c[:count] = costs
    rows, cols, vals, lo, hi = [], [], [], [], []
    for k in members:  # one strategy per op (or group of repeated ops)
        r = len(lo)
        for s in range(sizes[k]):
            rows.append(r), cols.append(start[k] + s), vals.append(1.0)
        lo.append(1.0), hi.append(1.0)
    col = count
    upper = np.r_[np.ones(total - 1), np.inf]
    for (u, v), table in edges.items():  # y[a, b] = x[u, a] * x[v, b] for one-hot x
        r = len(lo)
        nu, nv = sizes[u], sizes[v]
        for a in range(nu):
            rows.append(r + a), cols.append(start[u] + a), vals.append(-1.0)
        for b in range(nv):
            rows.append(r + nu + b), cols.append(start[v] + b), vals.append(-1.0)
        a_idx, b_idx = np.divmod(np.arange(nu * nv), nv)
        rows.extend((r + a_idx).tolist()), cols.extend((col + np.arange(nu * nv)).tolist())
        rows.extend((r + nu + b_idx).tolist()), cols.extend((col + np.arange(nu * nv)).tolist())
        vals.extend([1.0] * (2 * nu * nv))
        c[col:col + nu * nv] = table.ravel()
        if (u, v) in forbidden:
            upper[col:col + nu * nv][forbidden[(u, v)].ravel()] = 0.0
        col += nu * nv
        lo.extend([0.0] * (nu + nv)), hi.extend([0.0] * (nu + nv))
    if memory is not None:  # in units of the limit, so the solver's tolerances fit
        for k in members:
            r = len(lo)
            for s in range(sizes[k]):
                rows.append(r), cols.append(start[k] + s)
                vals.append(passing[start[k] + s] / memory)
            rows.append(r), cols.append(total - 1), vals.append(-1.0)
            lo.append(-np.inf), hi.append(0.0)
        r = len(lo)
        rows.append(r), cols.append(total - 1), vals.append(1.0)
        for i in range(count):
            rows.append(r), cols.append(i), vals.append(mem[i] / memory)
        col = count
        for held in edge_mem.values():
            for j in np.flatnonzero(held.ravel()):
                rows.append(r), cols.append(col + int(j))
                vals.append(float(held.flat[j]) / memory)
            col += held.size
        lo.append(0.0), hi.append(1.0)
    from scipy.optimize import Bounds, LinearConstraint, milp  # slow to import: on demand
    from scipy.sparse import coo_matrix

    A = coo_matrix((vals, (rows, cols)), shape=(len(lo), total)).tocsr()
    integrality = np.zeros(total)
    integrality[:count] = 1
    unit = float(np.abs(c).max()) or 1.0  # the solver's gaps are absolute as well as relative
    result = milp(c / unit, constraints=LinearConstraint(A, np.array(lo), np.array(hi)),
                  integrality=integrality, bounds=Bounds(0, upper),
                  options={"time_limit": time_limit, "mip_rel_gap": gap})
    if result.x is None:
        raise NoFit(sum(mem[start[k]:start[k] + sizes[k]].min() for k in members))
    x = result.x
    picked = {k: int(np.argmax(x[start[k]:start[k] + sizes[k]])) for k in members}
    choice = {op: space[op][picked[key[op]]] for op in ops}
    used = float(sum(mem[start[k] + s] for k, s in picked.items()) +
                 sum(held[picked[u], picked[v]] for (u, v), held in edge_mem.items()) +
                 max((passing[start[k] + s] for k, s in picked.items()), default=0.0))
    sync = sum(_op_sync(op, s, first[op], pricer) for op, s in choice.items()) + \
        sum(_shared(choice[reader], choice[op], j, i, reader.inputs[j], pricer)[0]
            for op, i, reader, j in later_reads(ops))
    held_bytes = sum(_output_bytes(op, s, mesh) for op, s in choice.items()) / micro + \
        sum(held[picked[u], picked[v]] for (u, v), held in edge_mem.items()) / in_flight
    return Solution(choice, float(result.fun) * unit, used, total, result.message, mesh, sync,
                    held_bytes)


def _edge_tables(made: list[Strategy], read: list[Strategy], out: int, i: int, t,
                 pricer: Pricer, needs_grad: set, micro: int, in_flight: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """An edge's seconds per pair of strategies, and the bytes of the copy a consumer
    keeps for backward when it reads another layout than made."""
    table = np.array([[_edge(ps.outputs[out], cs, i, t, pricer, needs_grad, micro)
                       for cs in read] for ps in made])
    held = np.array([[0.0 if ps.outputs[out] == cs.inputs[i] else
                      nbytes(t) / sharded(cs.inputs[i], pricer.mesh) * in_flight / micro
                      for cs in read] for ps in made])
    return table, held


def first_reads(ops: Sequence[Op]) -> dict[Op, list[int]]:
    """The weights each op is the first to read (whose memory its choice decides)."""
    seen: set = set()
    out = {}
    for op in ops:
        out[op] = [i for i, t in enumerate(op.inputs)
                   if t.kind is TensorKind.PARAM and t not in seen]
        seen.update(op.inputs[i] for i in out[op])
    return out


def later_reads(ops: Sequence[Op]) -> list[tuple[Op, int, Op, int]]:
    """Each read of a trainable weight an earlier op read first: (op, input, first reader,
    its input)."""
    first: dict[PTensor, tuple[Op, int]] = {}
    out = []
    for op in ops:
        for i, t in enumerate(op.inputs):
            if t.kind is not TensorKind.PARAM or t.frozen:
                continue
            if t in first:
                out.append((op, i, *first[t]))
            else:
                first[t] = (op, i)
    return out


def _shared_tables(first: list[Strategy], later: list[Strategy], j: int, i: int, t: PTensor,
                   pricer: Pricer) -> tuple[np.ndarray, np.ndarray]:
    """A weight's second reader against its first: the reduction its gradient adds to the
    first's, and the pairs that read the weight in different layouts (not allowed)."""
    pairs = [[_shared(a, b, j, i, t, pricer) for b in later] for a in first]
    return (np.array([[x for x, _ in row] for row in pairs]),
            np.array([[apart for _, apart in row] for row in pairs]))


def _shared(first: Strategy, later: Strategy, j: int, i: int, t: PTensor, pricer: Pricer
            ) -> tuple[float, bool]:
    if first.inputs[j] != later.inputs[i]:
        return 0.0, True
    size = nbytes(t)
    return max(0.0, pricer.reduction(later.grads[i], later.inputs[i], size) -
               pricer.reduction(first.grads[j], first.inputs[j], size)), False


def updates_cut(op: Op, s: Strategy, i: int) -> bool:
    """Whether ``s`` cuts the update of the weight ``op`` reads as input ``i`` over the
    devices (ZeRO): a trainable weight it reads whole."""
    return s.zero and not op.inputs[i].frozen and all(x == REPLICATE for x in s.inputs[i])


def _op_sync(op: Op, s: Strategy, first: list[int], pricer: Pricer) -> float:
    """Once a step, for the trainable weights the op reads first: their gradient reductions
    (what a later reader adds: ``_shared``) and the optimizer's update (memory bound, as
    the simulator prices it: a few passes over the bytes each device owns, a ZeRO share or
    its slice)."""
    total = 0.0
    for i, (t, lay, g) in enumerate(zip(op.inputs, s.inputs, s.grads)):
        if t.kind is TensorKind.PARAM and not t.frozen and i in first:
            total += pricer.reduction(g, lay, nbytes(t))
            cut = updates_cut(op, s, i)
            if cut:
                total += pricer.zero_calls(g)
            owned = pricer.mesh.devices if cut else sharded(lay, pricer.mesh)
            total += OPTIMIZER_PASSES * nbytes(t) / owned / pricer.cluster.copy_bandwidth
    return total


def _weight_bytes(op: Op, s: Strategy, first: list[int], states: float, mesh: Mesh) -> float:
    """Per device: the weights the op reads first, each with its gradient and optimizer
    state (those cut over every device under ZeRO)."""
    total = 0.0
    for i in first:
        t, lay = op.inputs[i], s.inputs[i]
        if updates_cut(op, s, i):
            total += nbytes(t) * (1 + (states - 1) / mesh.devices)
        else:
            total += (states if not t.frozen else 1) * nbytes(t) / sharded(lay, mesh)
    return total


def _output_bytes(op: Op, s: Strategy, mesh: Mesh) -> float:
    return sum(nbytes(t) / sharded(lay, mesh) for t, lay in zip(op.outputs, s.outputs))


def _gradient_bytes(op: Op, s: Strategy, mesh: Mesh, needs_grad: set) -> float:
    """Per device, the gradients an op's backward holds at once: its outputs' and its
    activation inputs'."""
    outs = sum(nbytes(t) / sharded(lay, mesh) for t, lay in zip(op.outputs, s.outputs)
               if t in needs_grad)
    return outs + sum(nbytes(t) / sharded(lay, mesh) for t, lay in zip(op.inputs, s.inputs)
                      if t in needs_grad and t.kind is not TensorKind.PARAM)


def _edge(made: Placements, consumer: Strategy, i: int, t, pricer: Pricer,
          needs_grad: set, micro: int = 1) -> float:
    """A tensor's layout change from its producer to a consumer, and its gradient's back
    (on one micro-batch's share of it)."""
    size = nbytes(t) // micro
    seconds = pricer.change(made, consumer.inputs[i], size)
    if t in needs_grad:
        seconds += pricer.change(consumer.grads[i], _wanted(made), size)
    return seconds


def price(graph: Graph, choice: dict[Op, Strategy], mesh: Mesh | int,
          cluster: Cluster) -> float:
    """The objective of a choice, term by term as ``solve`` prices it (to check a solution
    against, or to compare plans under the solver's model); infinite where a weight's
    readers read it in different layouts."""
    pricer = Pricer(Mesh((mesh,)) if isinstance(mesh, int) else mesh, cluster)
    needs_grad = differentiable(graph)
    ops = [op for op in graph.ops if op in choice]
    total = 0.0
    for op, i, reader, j in later_reads(ops):
        extra, apart = _shared(choice[reader], choice[op], j, i, reader.inputs[j], pricer)
        if apart:
            return float("inf")
        total += extra
    first = first_reads(ops)
    for op, s in choice.items():
        total += s.compute + _op_sync(op, s, first[op], pricer)
        for i, t in enumerate(op.inputs):
            if t.producer in choice:
                made = choice[t.producer].outputs[t.producer.outputs.index(t)]
                total += _edge(made, s, i, t, pricer, needs_grad)
    return total


def _wanted(output: Placements) -> Placements:
    """The layout of the gradient a producer's pieces need for an output held as ``output``:
    as held, or whole where they made partial sums (an addend's gradient is the sum's)."""
    return tuple(REPLICATE if lay == PARTIAL else lay for lay in output)
