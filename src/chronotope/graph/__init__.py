"""Capture and the graph IR: ops with dim signatures over whole tensors and their masks."""

from chronotope.graph.capture import capture
from chronotope.graph.execute import execute, run_graph
from chronotope.graph.ir import DEVICE, Graph, Op, PTensor, Source, TensorKind, TensorMeta
from chronotope.graph.mask import Mask, ValueRange, VTensor, covers_exactly_once
from chronotope.graph.ops import DEFAULT_REGISTRY, default_registry, register_op
from chronotope.graph.registry import OpRegistry
from chronotope.graph.signature import Signature

__all__ = [
    "DEFAULT_REGISTRY", "DEVICE", "Graph", "Mask", "Op", "OpRegistry", "PTensor", "Signature",
    "Source", "TensorKind", "TensorMeta", "VTensor", "ValueRange", "capture",
    "covers_exactly_once", "default_registry", "execute", "register_op", "run_graph",
]
