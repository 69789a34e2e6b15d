"""Signatures of Mixture-of-Experts layers: routed experts as one op, and the grouped matmul.

``grouped_mm(a, b, offs=...)`` multiplies runs of rows of ``a`` by one expert's
matrix each; ``offs`` holds where each run ends, counted from the first row.
A piece of the rows or of the experts would need offsets counted from its own
start, so with offsets the experts and rows stay whole and the features split
(tensor parallelism inside the experts: ``n``, and ``k`` as a reduction).
Without offsets (``(e, m, k) @ (e, k, n)``) it is a batched matmul, and the
experts split (expert parallelism), as they do in ``bmm`` and ``einsum``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chronotope.graph.experts import routed_experts
from chronotope.graph.ops.pointwise import join
from chronotope.graph.registry import OpCall, OpRegistry

aten = torch.ops.aten


def grouped_mm(call: OpCall) -> str | None:
    """``(s, k) x (e, k, n)`` by row runs, ``(e, m, k) x (e, k, n)``, or ``(m, K) x (K, n)``
    by runs of ``K`` (one output matrix per run); a bias is not covered."""
    a, b, *rest = call.tensors
    if call.arg(3, "bias") is not None:
        return None
    if not rest:  # no offsets: one matmul per expert
        if len(a.shape) != 3 or len(b.shape) != 3:
            return None
        return "e m k+, e k+ n -> e m n"
    if len(rest) != 1 or len(rest[0].shape) != 1:
        return None
    if len(a.shape) == 2 and len(b.shape) == 3:
        return f"{join(['s^', 'k+'], ['e^', 'k+', 'n'], ['e^'])} -> s^ n"
    if len(a.shape) == 2 and len(b.shape) == 2:
        return f"{join(['m', 'j^'], ['j^', 'n'], ['e^'])} -> e^ m n"
    return None


def routed(call: OpCall) -> str:
    """``chronotope::routed_experts`` (``graph/experts.py``): tokens split, each its own;
    the experts and their hidden features are sums (a piece's experts' part of each
    token); the model dim is both read and made, and the top-k slots stay whole."""
    weights = [["e+", "f+", "d^"]] * (2 if call.arg(4, "up") is not None else 1)
    return f"{join(['t', 'd^'], ['t', 'k^'], ['t', 'k^'], *weights, ['e+', 'd^', 'f+'])} -> t d^"


def register(reg: OpRegistry) -> None:
    targets: list[object] = [torch._grouped_mm, aten._grouped_mm,
                             "transformers::grouped_mm_fallback"]
    if hasattr(F, "grouped_mm"):
        targets.append(F.grouped_mm)
    reg.add(targets, "grouped_mm", grouped_mm)
    reg.add([routed_experts, torch.ops.chronotope.routed_experts], "experts", routed)
