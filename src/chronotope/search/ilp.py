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
          memory: float | None, optimizer: str = "adam", time_limit: float = 60.0
          ) -> Solution:
    ops = [op for op in graph.ops if space[op]]
    index: dict[tuple[Op, int], int] = {}
    costs: list[float] = []
    mem: list[float] = []
    states = 2 + OPTIMIZER_STATES.get(optimizer, 2)  # the weight, its gradient, its state
    seen_params: set = set()
    for op in ops:
        first_reads = [k for k, t in enumerate(op.inputs)
                       if t.kind is TensorKind.PARAM and t not in seen_params]
        seen_params.update(op.inputs[k] for k in first_reads)
        for s, strat in enumerate(space[op]):
            index[(op, s)] = len(costs)
            sync = sum(_bucketed(nbytes(t), n, cluster) for t, g in zip(op.inputs, strat.grads)
                       if t.kind is TensorKind.PARAM and not t.frozen and g == PARTIAL)
            costs.append(strat.compute + sync)
            held = sum(states * nbytes(op.inputs[k]) / (n if strat.inputs[k][0] == "S" else 1)
                       for k in first_reads)
            held += sum(nbytes(t) / (n if lay[0] == "S" else 1)
                        for t, lay in zip(op.outputs, strat.outputs))
            mem.append(held)
    choices = len(costs)
    needs_grad = differentiable(graph)
    edges = []
    for op in ops:
        for k, t in enumerate(op.inputs):
            producer = t.producer
            if producer is None or producer not in space or not space[producer]:
                continue
            out = producer.outputs.index(t)
            pairs = []
            for a, ps in enumerate(space[producer]):
                for b, cs in enumerate(space[op]):
                    seconds = change_seconds(ps.outputs[out], cs.inputs[k], nbytes(t), n,
                                             cluster)
                    if t in needs_grad:  # and its gradient, back
                        seconds += change_seconds(cs.grads[k], _wanted(ps.outputs[out]),
                                                  nbytes(t), n, cluster)
                    pairs.append((a, b, seconds))
            edges.append((producer, op, pairs))
    total = choices + sum(len(p) for _, _, p in edges)
    c = np.zeros(total)
    c[:choices] = costs
    rows = len(ops) + sum(len(space[u]) + len(space[v]) for u, v, _ in edges)
    A = lil_matrix((rows + (1 if memory is not None else 0), total))
    lo, hi = np.zeros(A.shape[0]), np.zeros(A.shape[0])
    r = 0
    for op in ops:  # one strategy per op
        for s in range(len(space[op])):
            A[r, index[(op, s)]] = 1
        lo[r] = hi[r] = 1
        r += 1
    col = choices
    for u, v, pairs in edges:  # y[a, b] = x[u, a] * x[v, b] for one-hot x
        for a in range(len(space[u])):
            A[r + a, index[(u, a)]] = -1
        for b in range(len(space[v])):
            A[r + len(space[u]) + b, index[(v, b)]] = -1
        for a, b, seconds in pairs:
            c[col] = seconds
            A[r + a, col] = 1
            A[r + len(space[u]) + b, col] = 1
            col += 1
        r += len(space[u]) + len(space[v])
    if memory is not None:
        for i, m in enumerate(mem):
            A[r, i] = m
        lo[r], hi[r] = 0, memory
    integrality = np.zeros(total)
    integrality[:choices] = 1
    result = milp(c, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
                  bounds=Bounds(0, 1), options={"time_limit": time_limit})
    if result.x is None:
        raise NoFit(_least_memory(ops, space, index, mem))
    x = result.x
    choice = {op: space[op][max(range(len(space[op])), key=lambda s: x[index[(op, s)]])]
              for op in ops}
    used = sum(mem[index[(op, space[op].index(s))]] for op, s in choice.items())
    return Solution(choice, float(result.fun), used, total, result.message)


def price(graph: Graph, choice: dict[Op, Strategy], n: int, cluster: Cluster) -> float:
    """The objective of a choice, term by term as ``solve`` prices it (to check a solution
    against, or to compare plans under the solver's model)."""
    needs_grad = differentiable(graph)
    total = 0.0
    for op, s in choice.items():
        total += s.compute + sum(_bucketed(nbytes(t), n, cluster)
                                 for t, g in zip(op.inputs, s.grads)
                                 if t.kind is TensorKind.PARAM and not t.frozen and g == PARTIAL)
        for k, t in enumerate(op.inputs):
            if t.producer not in choice:
                continue
            made = choice[t.producer].outputs[t.producer.outputs.index(t)]
            total += change_seconds(made, s.inputs[k], nbytes(t), n, cluster)
            if t in needs_grad:
                total += change_seconds(s.grads[k], _wanted(made), nbytes(t), n, cluster)
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


def _least_memory(ops, space, index, mem) -> float:
    return sum(min(mem[index[(op, s)]] for s in range(len(space[op]))) for op in ops)
