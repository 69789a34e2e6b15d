"""The dtype every tensor of a step has when it runs in 16 bits under ``torch.autocast``.

A bf16 or fp16 run keeps fp32 master weights and lets autocast choose each op's dtype
(``runtime/precision.py``): a linear's output is 16-bit, a layer norm's fp32, an add of
the two fp32. What a plan holds and sends depends on those choices, so planning in 16
bits needs them: they are inferred once per graph and dtype by running its ops on fake
tensors (shapes and dtypes only, no compute; about a second for GPT-3 175B's 2,000 ops).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from chronotope.graph.ir import Graph, Op, PTensor

# What a step computes in, by the names plans, the command line and the runtime use.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}
LOW = {name: d for name, d in DTYPES.items() if d != torch.float32}

_inferred: weakref.WeakKeyDictionary[Graph, dict[str, dict[PTensor, torch.dtype | None]]] = \
    weakref.WeakKeyDictionary()


def autocast_dtypes(graph: Graph, dtype: str) -> dict[PTensor, torch.dtype | None]:
    """Each tensor's dtype when ``graph`` runs under autocast in ``dtype`` ("bf16",
    "fp16"; "fp32": as captured); None for a tensor made after an op that could not be
    followed on fake tensors. CPU's autocast policy (a CUDA one needs a CUDA build to
    follow; both lower matmuls, convolutions and attention)."""
    if dtype not in LOW:
        return {t: t.dtype for op in graph.ops for t in (*op.inputs, *op.outputs)}
    known = _inferred.setdefault(graph, {})
    if dtype not in known:
        known[dtype] = _infer(graph, LOW[dtype])
    return known[dtype]


def casts(op: Op, dtypes: dict[PTensor, torch.dtype | None]) -> bool:
    """Whether autocast runs ``op`` in 16 bits on fp32 inputs: it makes a 16-bit copy of
    each (a weight's copy is saved for the backward with the op's other inputs)."""
    low = any(dtypes.get(t) in LOW.values() for t in op.outputs)
    return low and any(dtypes.get(t, t.dtype) == torch.float32 for t in op.inputs)


def itemsizes(graph: Graph, dtype: str) -> dict[PTensor, int]:
    """Bytes per element of each tensor as a run in ``dtype`` holds it (its captured
    dtype where unknown)."""
    return {t: (found or t.dtype).itemsize
            for t, found in autocast_dtypes(graph, dtype).items()}


def casting(graph: Graph, dtype: str) -> set[Op]:
    """The ops that keep a 16-bit copy of the fp32 tensors they read (``casts``)."""
    if dtype not in LOW:
        return set()
    dtypes = autocast_dtypes(graph, dtype)
    return {op for op in graph.ops if casts(op, dtypes)}


def _infer(graph: Graph, dtype: torch.dtype) -> dict[PTensor, torch.dtype | None]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from chronotope.graph.execute import run_op

    device = torch.device("cpu")
    values: dict[PTensor, Any] = {}
    dtypes: dict[PTensor, torch.dtype | None] = {}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, \
            torch.autocast("cpu", dtype=dtype, cache_enabled=False), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in graph.ops:
            for t in op.inputs:
                dtypes.setdefault(t, t.dtype if _leaf(t, graph) else None)
            outs: list[Any] = []
            if all(t in values or _leaf(t, graph) for t in op.inputs):
                try:
                    for t in op.inputs:
                        if t not in values:
                            values[t] = mode.from_tensor(
                                torch.empty(t.shape, dtype=t.dtype, device=device))
                    outs = run_op(op, values, device)
                except Exception:  # noqa: BLE001  (not followable on fake tensors: unknown)
                    outs = []
            for i, t in enumerate(op.outputs):
                made = outs[i] if i < len(outs) else None
                if isinstance(made, torch.Tensor):
                    values[t] = made
                dtypes[t] = made.dtype if isinstance(made, torch.Tensor) else None
    return dtypes


def _leaf(t: PTensor, graph: Graph) -> bool:
    return t in graph.inputs or t in graph.params.values() or t in graph.buffers.values() \
        or t.name in graph.constants

