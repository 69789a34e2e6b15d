"""Compute cost of a plan piece, from its signature alone.

A piece touches every combination of its dims once: an op with a reduced dim
(a matmul's ``k``) does a multiply and an add per combination, others one
operation. A backward costs twice its forward (gradients of the inputs and of
the weights); split in two (zero bubble), each part costs one forward. Coarse,
but it ranks stages and micro-batches the way a profile does, without running
anything.
"""

from __future__ import annotations

import math

from chronotope.errors import SignatureError
from chronotope.graph.ir import Op
from chronotope.graph.signature import Signature
from chronotope.plan.plan import PlanOp


def piece_flops(op: PlanOp) -> float:
    """Floating-point operations of one forward or backward piece."""
    fwd = op.forward or op
    sig = fwd.op.signature
    flops = _flops(sig, fwd.piece.sizes, fwd.op.kind) if sig is not None else \
        float(sum(math.prod(v.mask.shape) for v in fwd.outputs))
    return 2 * flops if op.is_backward and not op.split else flops


def op_flops(op: Op) -> float:
    """Floating-point operations of a whole graph op's forward."""
    outputs = float(sum(math.prod(t.shape) for t in op.outputs))
    if op.signature is None:
        return outputs  # one operation per output element
    try:
        sizes = op.signature.bind(op.input_shapes, [t.shape for t in op.outputs])
    except SignatureError:
        return outputs
    return _flops(op.signature, sizes, op.kind)


def _flops(sig: Signature, sizes: dict[str, int], kind: str = "") -> float:
    """One operation per combination of the dims, two where a dim is reduced; dims that
    each belong to one tensor alone (a concatenation's inputs' and output's) are not
    combined with each other: the tensor with most of them counts. Attention is two
    contractions (scores over ``E``, then values over ``S``), not one over all, and a
    lookup copies one row per index, whatever the table's length ``v``."""
    if kind == "attention" and {"L", "S", "E", "Ev"} <= set(sizes):
        rows = math.prod(v for n, v in sizes.items() if n not in ("L", "S", "E", "Ev"))
        return 2.0 * rows * sizes["L"] * sizes["S"] * (sizes["E"] + sizes["Ev"])
    if kind == "embedding":
        return float(math.prod(v for n, v in sizes.items() if n != "v"))
    reduced = any(d.reduce for d in sig.dims())
    tensors = [{d.name for a in t for d in a.factors if d.size is None}
               for t in (*sig.inputs, *sig.outputs)]
    shared = [n for n in sig.names() if sum(n in t for t in tensors) > 1]
    own = max((math.prod(sizes.get(n, 1) for n in t if n not in shared) for t in tensors),
              default=1)
    return float(math.prod(sizes.get(n, 1) for n in shared) * own) * (2 if reduced else 1)
