"""The single-device run every plan is compared with, and the comparison itself."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from chronotope.graph.capture import model_loss
from chronotope.models.workload import Workload
from chronotope.runtime.local import Optim, RunResult


def train_reference(workload: Workload, steps: int, optim: Optim) -> RunResult:
    """Train a copy of the model as written, on one device, with the same optimizer."""
    model = copy.deepcopy(workload.model)
    opt = optim.build(list(model.parameters()))
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(*workload.inputs, **workload.kwargs)
        loss = workload.loss_fn(out, *workload.targets) if workload.loss_fn else model_loss(out)
        loss.backward()
        if optim.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip)
        opt.step()
        losses.append(float(loss.detach()))
    return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


@dataclass(frozen=True)
class Difference:
    max_loss_rel_diff: float
    max_param_rel_diff: float


def compare(run: RunResult, reference: RunResult) -> Difference:
    """Largest relative differences: per-step losses, and parameters against their scale.

    Parameters are compared against the largest reference value of all of them, so
    tensors whose gradient is zero in exact arithmetic (an attention key's bias)
    do not turn rounding noise into a large ratio.
    """
    loss = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(run.losses, reference.losses)),
               default=0.0)
    scale = max(float(p.abs().max()) for p in reference.params.values())
    param = max(float((run.params[n] - p).abs().max()) for n, p in reference.params.items())
    return Difference(loss, param / max(scale, 1e-12))
