"""The built-in op signatures."""

from __future__ import annotations

from chronotope.graph.ops import moe, nn, norms, pointwise, random, select, shape, vision
from chronotope.graph.registry import OpRegistry, register_op


def default_registry() -> OpRegistry:
    """A fresh registry with every built-in op, to add entries to."""
    reg = OpRegistry()
    for module in (pointwise, shape, nn, vision, norms, select, moe, random):
        module.register(reg)
    return reg


# What capture looks ops up in, unless given another registry; frozen (user ops made with
# @chronotope.register_op carry their own entries).
DEFAULT_REGISTRY = default_registry().freeze()

__all__ = ["DEFAULT_REGISTRY", "default_registry", "register_op"]
