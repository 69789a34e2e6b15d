"""The built-in op signatures."""

from __future__ import annotations

from chronotope.graph.ops import moe, nn, norms, pointwise, random, select, shape, vision
from chronotope.graph.registry import OpRegistry


def default_registry() -> OpRegistry:
    """A fresh registry with every built-in op; users add theirs with ``register``."""
    reg = OpRegistry()
    for module in (pointwise, shape, nn, vision, norms, select, moe, random):
        module.register(reg)
    return reg


# Where @chronotope.register_op puts user ops; capture(registry=...) takes another one.
DEFAULT_REGISTRY = default_registry()
register_op = DEFAULT_REGISTRY.register
