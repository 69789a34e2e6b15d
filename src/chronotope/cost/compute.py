"""Compute cost of a plan piece, from its signature alone: its FLOPs and the bytes it
moves to and from the device's memory (``Cluster.compute`` takes the slower).

A piece touches every combination of its dims once: an op with a reduced dim
(a matmul's ``k``) does a multiply and an add per combination, others one
operation. It reads its inputs and writes its outputs once (a view moves nothing,
a lookup reads the rows it copies). A backward costs twice its forward (gradients
of the inputs and of the weights); split in two (zero bubble), each part costs one
forward. Coarse, but it ranks stages and micro-batches the way a profile does,
without running anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from chronotope.errors import SignatureError
from chronotope.graph.attention import is_causal, visible
from chronotope.graph.autocast import itemsizes, saves
from chronotope.graph.ir import Graph, Op, TensorKind
from chronotope.graph.mask import Index
from chronotope.graph.signature import Signature
from chronotope.plan.plan import PlanOp


def piece_flops(op: PlanOp) -> float:
    """Floating-point operations of one forward or backward piece."""
    fwd = op.forward or op
    sig = fwd.op.signature
    flops = _flops(sig, fwd.piece.sizes, fwd.op.kind, _experts(fwd.op)) if sig is not None \
        else float(sum(math.prod(v.mask.shape) for v in fwd.outputs))
    flops *= _kept(fwd.op, fwd.outputs[0].mask.index)
    return 2 * flops if op.is_backward and not op.split else flops


def _kept(op: Op, box: Index) -> float:
    """A piece of a causal attention holding ``box`` of its output: how much more of its
    query-key pairs the mask keeps than the whole op's share (rows late in the sequence see
    more keys), so its pieces' FLOPs add up to the op's (1 for any other op)."""
    if op.kind != "attention" or not is_causal(op.args, op.kwargs):
        return 1.0
    keys, rows = op.inputs[1].shape[-2], op.outputs[0].shape[-2]
    return visible(box[-2], keys) / visible((0, rows), keys)


class Traffic:
    """Bytes each op's pieces move when ``graph`` runs in ``dtype`` (16-bit activations
    under bf16 or fp16)."""

    def __init__(self, graph: Graph, dtype: str = "fp32") -> None:
        self.size = itemsizes(graph, dtype)
        self.views = {op for op, kept in saves(graph, dtype).items()
                      if len(kept.views) == len(op.outputs)}

    def forward(self, op: Op, inputs: Sequence[float], outputs: Sequence[float]) -> float:
        """Bytes a forward piece of ``op`` moves that holds ``inputs`` and ``outputs``
        elements of each of its tensors."""
        if op in self.views:
            return 0.0
        written = sum(n * self.size.get(t, t.dtype.itemsize) for n, t in zip(outputs, op.outputs))
        read = sum(written if op.kind == "embedding" and t.kind is TensorKind.PARAM
                   else n * self.size.get(t, t.dtype.itemsize) for n, t in zip(inputs, op.inputs))
        return float(read + written)

    def piece(self, piece: PlanOp) -> float:
        """Bytes one forward or backward piece moves."""
        fwd = piece.forward or piece
        moved = self.forward(fwd.op, [v.mask.numel for v in fwd.inputs],
                             [v.mask.numel for v in fwd.outputs])
        return 2 * moved if piece.is_backward and not piece.split else moved


def op_flops(op: Op) -> float:
    """Floating-point operations of a whole graph op's forward."""
    outputs = float(sum(math.prod(t.shape) for t in op.outputs))
    if op.signature is None:
        return outputs  # one operation per output element
    try:
        sizes = op.signature.bind(op.input_shapes, [t.shape for t in op.outputs])
    except SignatureError:
        return outputs
    return _flops(op.signature, sizes, op.kind, _experts(op))


def _experts(op: Op) -> int:
    """How many experts a routed-experts op holds (0 for any other op)."""
    return op.inputs[3].shape[0] if op.kind == "experts" else 0


def _flops(sig: Signature, sizes: dict[str, int], kind: str = "", experts: int = 0) -> float:
    """One operation per combination of the dims, two where a dim is reduced; dims that
    each belong to one tensor alone (a concatenation's inputs' and output's) are not
    combined with each other: the tensor with most of them counts. Attention is two
    contractions (scores over ``E``, then values over ``S``), not one over all, a
    lookup copies one row per index, whatever the table's length ``v``, and routed
    experts run each token's ``k`` picks through two or three matrices, a piece of the
    ``experts`` its share of them."""
    if kind == "attention" and {"L", "S", "E", "Ev"} <= set(sizes):
        rows = math.prod(v for n, v in sizes.items() if n not in ("L", "S", "E", "Ev"))
        return 2.0 * rows * sizes["L"] * sizes["S"] * (sizes["E"] + sizes["Ev"])
    if kind == "experts" and experts:
        matrices = 3 if len(sig.inputs) == 6 or sig.inputs[3][1].grouped else 2
        return 2.0 * sizes["t"] * sizes["k"] * sizes["d"] * sizes["f"] * matrices * \
            sizes["e"] / experts
    if kind == "embedding":
        return float(math.prod(v for n, v in sizes.items() if n != "v"))
    reduced = any(d.reduce for d in sig.dims())
    tensors = [{d.name for a in t for d in a.factors if d.size is None}
               for t in (*sig.inputs, *sig.outputs)]
    shared = [n for n in sig.names() if sum(n in t for t in tensors) > 1]
    own = max((math.prod(sizes.get(n, 1) for n in t if n not in shared) for t in tensors),
              default=1)
    return float(math.prod(sizes.get(n, 1) for n in shared) * own) * (2 if reduced else 1)
