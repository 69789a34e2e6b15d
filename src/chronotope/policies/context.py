"""Context parallelism: every op along the sequence over a group of ``cp`` devices.

The sequence (axis 1 of the batch inputs) is followed through the graph, past the
flatten of ``(b t)`` before a token loss (``graph.axes.sequence_cuts``), and each op
that carries it is cut into chunks of it, so every activation a device holds is its
chunks' share: embeddings, norms, MLPs and the loss over tokens fall as 1 / cp.
Attention is where the chunks meet, in one of three ways:

* ``allgather`` (Llama 3's): each query chunk is a piece of the attention that reads
  the keys and values whole, which the compiler gathers from the chunks' devices (and
  sums their gradients back); a causal piece masks by where its rows sit and stops at
  its last row (``graph/attention.py``);
* ``ring``: the same pieces, with the keys and values landing a device at a time, each
  block attended to as it lands and merged by log-sum-exp, so the gather moves while
  attention computes (``compile/ring.py``);
* ``ulysses`` (DeepSpeed-Ulysses): the attention is cut by heads over the group, and
  the compiler turns the sequence chunks into head groups and back (all-to-all).

Under a causal mask a chunk late in the sequence sees more keys than an early one, so
with ``zigzag`` the sequence is cut into ``2 * cp`` chunks and device ``i`` holds chunks
``i`` and ``2 * cp - 1 - i``: every device then does the same work.
Ops that never see the sequence (weights alone) run on every device of the group,
and what is linear in per-chunk sums (a token-mean loss over its count) takes its
share of them, as under data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from chronotope.errors import PlanError
from chronotope.graph.attention import is_causal
from chronotope.graph.axes import SeqCut, loss_tails, sequence_cuts
from chronotope.graph.ir import Graph, Op
from chronotope.plan import Plan, Replicate, Split, ValueSplit
from chronotope.plan.plan import PlanOp

VARIANTS = ("allgather", "ring", "ulysses")


@dataclass(frozen=True)
class Context:
    """How a ``cp`` group cuts the graph: each op's sequence cut, the loss tails, the
    attention variant and the chunks (``2 * cp`` in a zigzag)."""

    cp: int
    cuts: dict[Op, SeqCut | None]
    tails: dict[Op, tuple[int, ...]]
    variant: str
    zigzag: bool

    @property
    def chunks(self) -> int:
        return 2 * self.cp if self.zigzag else self.cp

    def owner(self, chunk: int) -> int:
        """The group device that holds sequence chunk ``chunk``."""
        return chunk if chunk < self.cp else 2 * self.cp - 1 - chunk


def context(graph: Graph, cp: int, variant: str = "allgather",
            zigzag: bool | None = None) -> Context:
    """The cuts of ``graph`` over a ``cp`` group; ``zigzag`` defaults to whether a causal
    attention is cut by its queries (``allgather``, ``ring``)."""
    if cp < 1:
        raise PlanError(f"context parallelism needs cp >= 1, got cp={cp}")
    if variant not in VARIANTS:
        raise PlanError(f"unknown context-parallel attention {variant!r}: use one of "
                        f"{', '.join(VARIANTS)}")
    cuts, _ = sequence_cuts(graph)
    attention = [op for op in graph.ops if op.kind == "attention"]
    if cp > 1 and not any(cuts[op] is not None for op in attention):
        where = "it calls no scaled_dot_product_attention" if not attention else \
            "no attention's queries carry the sequence of its inputs (axis 1)"
        raise PlanError(f"context parallelism cuts attention along the sequence, and "
                        f"{graph.name} has none to cut: {where}")
    if zigzag is None:
        zigzag = variant in ("allgather", "ring") and any(
            is_causal(op.args, op.kwargs) for op in attention if cuts[op] is not None)
    dims = {op: cut.dim if cut is not None else None for op, cut in cuts.items()}
    tails = loss_tails(graph, dims, graph.registry) if graph.registry is not None else {}
    made = Context(cp, cuts, tails, variant, zigzag)
    short = [(op, cut) for op, cut in cuts.items()
             if cut is not None and cp > 1 and cut.length % made.chunks]
    if short:
        op, cut = short[0]
        raise PlanError(f"context parallelism over {cp} devices cuts the sequence into "
                        f"{made.chunks} chunks{' (a zigzag)' if zigzag else ''}, and "
                        f"{op.name} holds a sequence of {cut.length}: use a sequence length "
                        f"divisible by {made.chunks}")
    return made


def cut(plan: Plan, piece: PlanOp, ctx: Context) -> list[tuple[int, PlanOp]]:
    """``piece`` cut over the group: each sub-piece with the group device it runs on."""
    if ctx.cp == 1:
        return [(0, piece)]
    op = piece.op
    if op.kind == "attention" and ctx.variant == "ulysses" and ctx.cuts.get(op) is not None:
        return list(enumerate(plan.trans(piece, Split(_heads(op, piece, ctx.cp), ctx.cp))))
    seq = ctx.cuts.get(op)
    if seq is None:
        algo = ValueSplit(ctx.cp, ctx.tails[op]) if op in ctx.tails else Replicate(ctx.cp)
        return list(enumerate(plan.trans(piece, algo)))
    rows = [piece]
    for lead in seq.lead:  # a flatten of (b t): one sample's rows at a time
        rows = [one for r in rows for one in plan.trans(r, Split(lead, r.piece.sizes[lead]))]
    placed = []
    for r in rows:
        runs = r.piece.sizes[seq.dim] // (seq.length * seq.inner)
        for k, sub in enumerate(plan.trans(r, Split(seq.dim, runs * ctx.chunks))):
            placed.append((ctx.owner(k % ctx.chunks), sub))
    return placed


def _heads(op: Op, piece: PlanOp, cp: int) -> str:
    """The dim of an attention's heads (the query's third axis from the end), which
    Ulysses cuts ``cp`` ways."""
    assert op.signature is not None  # (an attention cut along the sequence)
    dims = op.signature.inputs[0]
    if len(dims) < 3 or not dims[-3].factors[0].splittable \
            or piece.piece.sizes[dims[-3].factors[0].name] % cp:
        raise PlanError(f"{op.name}: Ulysses cuts attention by heads over {cp} devices, and "
                        f"its {'heads do not divide' if len(dims) >= 3 else 'query has no heads'}"
                        f"; use cp_attention='allgather'")
    return dims[-3].factors[0].name
