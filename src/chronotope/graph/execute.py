"""The reference executor: run a captured Graph on one device, op by op.

Every distributed plan is judged against this run, so it does nothing clever:
each op calls the same function the model called, and tensors are freed after
their last use.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from chronotope.errors import CaptureError
from chronotope.graph.batch import Batch
from chronotope.graph.ir import DEVICE, Graph, Op, PTensor
from chronotope.graph.registry import iter_tensors, map_leaves
from chronotope.workload import Workload


def run_op(op: Op, values: Mapping[PTensor, torch.Tensor], device: torch.device) -> list[Any]:
    """Call one op on real tensors; returns its tensor outputs in order."""

    def real(x: Any) -> Any:
        if isinstance(x, PTensor):
            return values[x]
        return device if x is DEVICE else x

    args, kwargs = map_leaves(op.args, real), map_leaves(op.kwargs, real)
    if isinstance(op.target, str):
        result = getattr(args[0], op.target)(*args[1:], **kwargs)
    else:
        result = op.target(*args, **kwargs)
    return [x for x in iter_tensors(result) if isinstance(x, torch.Tensor)]


def last_uses(graph: Graph) -> dict[int, list[PTensor]]:
    """For each op index, the tensors nobody reads after it."""
    last: dict[PTensor, int] = {}
    for i, op in enumerate(graph.ops):
        for t in op.inputs:
            last[t] = i
    free: dict[int, list[PTensor]] = {}
    for t, i in last.items():
        if t is not graph.loss:
            free.setdefault(i, []).append(t)
    return free


def bind(graph: Graph, leaves: Mapping[str, torch.Tensor]
         ) -> tuple[dict[PTensor, torch.Tensor], torch.device]:
    """The graph's leaf tensors given by name (constants default to the captured ones),
    and the device they are on."""
    named = {t.name: t for t in [*graph.inputs, *graph.params.values(), *graph.buffers.values()]}
    values: dict[PTensor, torch.Tensor] = {}
    for name, t in named.items():
        if name not in leaves:
            raise CaptureError(f"{graph.name}: no value given for {t.kind} {name}")
        values[t] = leaves[name]
    consts = {t.name: t for op in graph.ops for t in op.inputs if t.name in graph.constants}
    for name, t in consts.items():
        values[t] = leaves.get(name, graph.constants[name])
    return values, next((v.device for v in values.values()), torch.device("cpu"))


def run_graph(graph: Graph, leaves: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Run the graph given its inputs, parameters, buffers and constants by name."""
    return run_step(graph, leaves)[0]


def run_step(graph: Graph, leaves: Mapping[str, torch.Tensor]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``run_graph``'s loss, and the new value of each buffer the step updates, by name."""
    values, device = bind(graph, leaves)
    free = last_uses(graph)
    kept = {*graph.buffer_updates.values(), graph.loss}
    with torch.device(device):
        for i, op in enumerate(graph.ops):
            for t, v in zip(op.outputs, run_op(op, values, device), strict=True):
                values[t] = v
            for t in free.get(i, ()):
                if t not in kept:
                    values.pop(t, None)
    return values[graph.loss], {n: values[t] for n, t in graph.buffer_updates.items()}


def execute(
    graph: Graph,
    model: nn.Module | Workload,
    example_inputs: Any = (),
    *,
    kwargs: Mapping[str, Any] | None = None,
    targets: tuple[Any, ...] = (),
) -> torch.Tensor:
    """Run the graph with the model's own parameters, so ``loss.backward()`` fills their grads."""
    return run_graph(graph, leaves_of(graph, model, example_inputs, kwargs=kwargs,
                                      targets=targets))


def leaves_of(
    graph: Graph,
    model: nn.Module | Workload,
    example_inputs: Any = (),
    *,
    kwargs: Mapping[str, Any] | None = None,
    targets: tuple[Any, ...] = (),
) -> dict[str, torch.Tensor]:
    """The graph's inputs (checked against the captured shapes), parameters and buffers by
    name, from a model and its example batch."""
    if isinstance(model, Workload):
        w = model
        model, example_inputs, kwargs, targets = w.model, w.inputs, w.kwargs, w.targets
    batch = Batch.of(example_inputs, kwargs, targets).tensors()
    if len(batch) != len(graph.inputs):
        raise CaptureError(
            f"{graph.name}: the graph takes {len(graph.inputs)} input tensors "
            f"({', '.join(t.name for t in graph.inputs)}), got {len(batch)}"
        )
    leaves: dict[str, torch.Tensor] = {}
    for t, value in zip(graph.inputs, batch):
        if tuple(value.shape) != t.shape or value.dtype != t.dtype:
            raise CaptureError(
                f"{graph.name}: input {t.name} was captured as {t.meta}, got "
                f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}; capture again "
                "for a new shape"
            )
        leaves[t.name] = value
    leaves.update(model.named_parameters())
    leaves.update(model.named_buffers())
    return leaves
