"""Intra-op search as an integer linear program (Alpa's formulation), solved by HiGHS.

One binary per op and strategy, exactly one chosen per op; one continuous variable per
producer-consumer edge and pair of strategies, equal to the product of the two choices
(its rows sum to the producer's choice, its columns to the consumer's), priced by the
layout changes the pair needs forward (the tensor) and backward (its gradient). The
objective adds each op's compute and the gradient all-reduce of every parameter it
reads whole while cutting its batch; per-device memory (parameters, gradients,
optimizer state, activations) is bounded by the limit.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from chronotope.cost.network import Cluster
from chronotope.graph.ir import Graph, Op, TensorKind
from chronotope.plan.check import OPTIMIZER_STATES
from chronotope.plan.plan import differentiable
from chronotope.search.space import PARTIAL, Strategy, change_seconds, nbytes


@dataclass
class Solution:
    choice: dict[Op, Strategy]
    seconds: float  # the objective: predicted step time, before overlap
    memory: float  # the model's per-device bytes of the choice
    variables: int
    status: str


class NoFit(Exception):
    """No choice fits the memory limit; carries the smallest memory any choice needs."""

    def __init__(self, least: float) -> None:
        super().__init__(least)
        self.least = least


def solve(graph: Graph, space: dict[Op, list[Strategy]], n: int, cluster: Cluster,
          memory: float | None, optimizer: str = "adam", time_limit: float = 60.0,
          groups: dict[Op, Hashable] | None = None) -> Solution:
    """The cheapest choice within ``memory``; ops in one of ``groups`` (repeated layers'
    ops, ``space.repeated``) share one decision, so the program grows with the distinct
    ops, not with depth."""
    ops = [op for op in graph.ops if space[op]]
    key = {op: (groups or {}).get(op, op) for op in ops}
    members: dict[Hashable, list[Op]] = {}
    for op in ops:
        members.setdefault(key[op], []).append(op)
    index: dict[tuple[Hashable, int], int] = {}
    costs: list[float] = []
    mem: list[float] = []
    for k, group in members.items():
        for s in range(len(space[group[0]])):
            index[(k, s)] = len(costs)
            costs.append(0.0)
            mem.append(0.0)
    states = 2 + OPTIMIZER_STATES.get(optimizer, 2)  # the weight, its gradient, its state
    seen_params: set = set()
    for op in ops:
        first_reads = [i for i, t in enumerate(op.inputs)
                       if t.kind is TensorKind.PARAM and t not in seen_params]
        seen_params.update(op.inputs[i] for i in first_reads)
        for s, strat in enumerate(space[op]):
            at = index[(key[op], s)]
            costs[at] += strat.compute + sum(
                _bucketed(nbytes(t), n, cluster) for t, g in zip(op.inputs, strat.grads)
                if t.kind is TensorKind.PARAM and not t.frozen and g == PARTIAL)
            mem[at] += sum(states * nbytes(op.inputs[i]) / (n if strat.inputs[i][0] == "S" else 1)
                           for i in first_reads)
            mem[at] += sum(nbytes(t) / (n if lay[0] == "S" else 1)
                           for t, lay in zip(op.outputs, strat.outputs))
    choices = len(costs)
    needs_grad = differentiable(graph)
    edges: dict[tuple[Hashable, Hashable], np.ndarray] = {}  # summed over repeated edges
    for op in ops:
        for i, t in enumerate(op.inputs):
            producer = t.producer
            if producer is None or not space.get(producer):
                continue
            out = producer.outputs.index(t)
            table = np.array([[_edge(ps.outputs[out], cs, i, t, n, cluster, needs_grad)
                               for cs in space[op]] for ps in space[producer]])
            pair = (key[producer], key[op])
            edges[pair] = edges[pair] + table if pair in edges else table
    total = choices + sum(t.size for t in edges.values())
    c = np.zeros(total)
    c[:choices] = costs
    sizes = {k: len(space[g[0]]) for k, g in members.items()}
    rows = len(members) + sum(sizes[u] + sizes[v] for u, v in edges)
    A = lil_matrix((rows + (1 if memory is not None else 0), total))
    lo, hi = np.zeros(A.shape[0]), np.zeros(A.shape[0])
    r = 0
    for k in members:  # one strategy per op (or group of repeated ops)
        for s in range(sizes[k]):
            A[r, index[(k, s)]] = 1
        lo[r] = hi[r] = 1
        r += 1
    col = choices
    for (u, v), table in edges.items():  # y[a, b] = x[u, a] * x[v, b] for one-hot x
        for a in range(sizes[u]):
            A[r + a, index[(u, a)]] = -1
        for b in range(sizes[v]):
            A[r + sizes[u] + b, index[(v, b)]] = -1
        for a in range(sizes[u]):
            for b in range(sizes[v]):
                c[col] = table[a, b]
                A[r + a, col] = 1
                A[r + sizes[u] + b, col] = 1
                col += 1
        r += sizes[u] + sizes[v]
    if memory is not None:
        for i, m in enumerate(mem):
            A[r, i] = m
        lo[r], hi[r] = 0, memory
    integrality = np.zeros(total)
    integrality[:choices] = 1
    result = milp(c, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
                  bounds=Bounds(0, 1), options={"time_limit": time_limit})
    if result.x is None:
        raise NoFit(sum(min(mem[index[(k, s)]] for s in range(sizes[k])) for k in members))
    x = result.x
    picked = {k: max(range(sizes[k]), key=lambda s: x[index[(k, s)]]) for k in members}
    choice = {op: space[op][picked[key[op]]] for op in ops}
    used = sum(mem[index[(k, s)]] for k, s in picked.items())
    return Solution(choice, float(result.fun), used, total, result.message)


def _edge(made: str, consumer: Strategy, i: int, t, n: int, cluster: Cluster,
          needs_grad: set) -> float:
    """A tensor's layout change from its producer to a consumer, and its gradient's back."""
    seconds = change_seconds(made, consumer.inputs[i], nbytes(t), n, cluster)
    if t in needs_grad:
        seconds += change_seconds(consumer.grads[i], _wanted(made), nbytes(t), n, cluster)
    return seconds


def price(graph: Graph, choice: dict[Op, Strategy], n: int, cluster: Cluster) -> float:
    """The objective of a choice, term by term as ``solve`` prices it (to check a solution
    against, or to compare plans under the solver's model)."""
    needs_grad = differentiable(graph)
    total = 0.0
    for op, s in choice.items():
        total += s.compute + sum(_bucketed(nbytes(t), n, cluster)
                                 for t, g in zip(op.inputs, s.grads)
                                 if t.kind is TensorKind.PARAM and not t.frozen and g == PARTIAL)
        for i, t in enumerate(op.inputs):
            if t.producer in choice:
                made = choice[t.producer].outputs[t.producer.outputs.index(t)]
                total += _edge(made, s, i, t, n, cluster, needs_grad)
    return total


def _bucketed(size: int, n: int, cluster: Cluster) -> float:
    """A gradient's share of the all-reduce that sums all of them at once (the compiler
    reduces a step's gradients in one call): its bytes' time, the call's latency aside."""
    return change_seconds(PARTIAL, "R", size, n, cluster) - \
        change_seconds(PARTIAL, "R", 0, n, cluster)


def _wanted(output: str) -> str:
    """The layout of the gradient a producer's pieces need for an output held as ``output``:
    as held, or whole where they made partial sums (an addend's gradient is the sum's)."""
    return "R" if output == PARTIAL else output


