"""The single-device run every plan is compared with, and the comparison itself."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from chronotope.graph.batch import model_loss
from chronotope.graph.rng import CounterRandom, Stream
from chronotope.runtime.local import Optim, RunResult
from chronotope.runtime.optim import step_schedule
from chronotope.runtime.precision import Precision
from chronotope.workload import Workload


def train_reference(workload: Workload, steps: int, optim: Optim,
                    precision: Precision | None = None) -> RunResult:
    """Train a copy of the model as written, on one device, with the same optimizer; its
    random ops draw from the counter-based stream, as a plan's pieces do.

    With ``precision``: forward and loss under its autocast (fp32 weights, as a plan's
    ranks keep them), and under fp16 the loss scaled as ``torch.amp.GradScaler`` does it
    (the same ``LossScale`` as the ranks', so both skip the same steps)."""
    model = copy.deepcopy(workload.model)
    opt = optim.build(list(model.parameters()))
    rates = optim.scheduler(opt, steps)
    losses: list[float] = []
    unreplayed: list[str] = []
    low = precision is not None and precision.low
    scaler = precision.scaler() if low else None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with CounterRandom(Stream(step=step)) as draws, \
                (precision.autocast(device.type) if low else contextlib.nullcontext()):
            out = model(*workload.inputs, **workload.kwargs)
            loss = workload.loss_fn(out, *workload.targets) if workload.loss_fn \
                else model_loss(out)
        unreplayed += [name for name in draws.unreplayed if name not in unreplayed]
        losses.append(float(loss.detach()))
        if scaler is None:
            loss.backward()
        else:
            loss.backward(torch.full_like(loss, scaler.scale))
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if not scaler.update(bool(scaler.unscale_(grads, 1.0, device).item() > 0)):
                step_schedule(rates, losses[-1])
                continue  # an inf or NaN: the step is skipped, the scale backs off
        if optim.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip)
        opt.step()
        step_schedule(rates, losses[-1])
    return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()},
                     buffers={n: b.detach().clone() for n, b in model.named_buffers()},
                     unreplayed=unreplayed)


@dataclass(frozen=True)
class Difference:
    """Largest relative differences from the single-device run; ``nan`` or ``inf`` when
    either run has a non-finite value or the runs do not even line up."""

    max_loss_rel_diff: float
    max_param_rel_diff: float
    max_buffer_rel_diff: float = 0.0  # running statistics and other buffers the step changes

    def within(self, tol: float) -> bool:
        """Every difference at most ``tol``: false for ``nan``, as a NaN is never a match."""
        return (self.max_loss_rel_diff <= tol and self.max_param_rel_diff <= tol
                and self.max_buffer_rel_diff <= tol)


def compare(run: RunResult, reference: RunResult) -> Difference:
    """Largest relative differences: per-step losses, and parameters (and buffers) against
    their scale.

    Parameters are compared against the largest reference value of all of them, so
    tensors whose gradient is zero in exact arithmetic (an attention key's bias)
    do not turn rounding noise into a large ratio. A NaN anywhere makes the difference
    NaN; a step, parameter or buffer one run lacks (or a shape that differs) makes it inf.
    """
    if len(run.losses) != len(reference.losses):
        loss = math.inf
    else:
        loss = _worst(abs(a - b) / max(abs(b), 1e-12)
                      for a, b in zip(run.losses, reference.losses))
    return Difference(loss, _state_difference(run.params, reference.params),
                      _state_difference(run.buffers, reference.buffers))


def _state_difference(run: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest difference of tensors against the largest reference value of them all;
    inf when a tensor is missing or shaped differently."""
    if run.keys() != reference.keys() or any(
            run[n].shape != t.shape for n, t in reference.items()):
        return math.inf
    scale = _worst(float(t.double().abs().max()) for t in reference.values() if t.numel())
    worst = _worst(float((run[n].double() - t.double()).abs().max())
                   for n, t in reference.items() if t.numel())
    return worst / max(scale, 1e-12)


def _worst(values: Iterable[float]) -> float:
    """The largest value, or NaN if any is NaN (Python's ``max`` keeps a NaN only if first)."""
    worst = 0.0
    for v in values:
        if math.isnan(v):
            return math.nan
        worst = max(worst, v)
    return worst
