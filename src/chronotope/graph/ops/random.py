"""Signatures of the counter-based random ops (``chronotope.graph.rng``).

Each piece draws exactly its own slice of the whole op's numbers, so every dim
of a dropout or a ``rand_like`` splits like an elementwise op's.
"""

from __future__ import annotations

from chronotope.graph import rng
from chronotope.graph.ops.nn import attention
from chronotope.graph.ops.pointwise import names, pointwise
from chronotope.graph.registry import OpCall, OpRegistry


def _made(call: OpCall) -> str:
    """A tensor made from sizes alone, every dim splittable."""
    return f"-> {' '.join(names(len(call.out.shape)))}"


def register(reg: OpRegistry) -> None:
    reg.add([rng.dropout, rng.native_dropout], "dropout", pointwise)
    reg.add([rng.rand_like, rng.randn_like, rng.bernoulli, rng.fill_uniform, rng.fill_normal,
             rng.fill_exponential], "random", pointwise)
    reg.add([rng.rand, rng.randn], "random", _made)
    reg.add([rng.attention], "attention", attention)
