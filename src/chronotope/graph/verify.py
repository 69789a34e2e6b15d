"""Capture checks itself: the captured step against the model as written, on the example batch.

Capture rewrites what it traces (in-place writes into SSA form, ``torch.no_grad()`` blocks
into detached reads, a custom ``autograd.Function`` into one op); any idiom it gets wrong
would train a different model without a word. So after capture, the step runs twice on
the example batch, once as the graph and once as the model itself under eager autograd,
and the loss, every parameter's gradient and every buffer the step changes must agree. A
difference is a ``CaptureMismatch`` naming what differs and the ops where the gradient
can first part from eager's, with their source lines.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from chronotope.errors import CaptureError
from chronotope.graph.execute import run_step
from chronotope.graph.ir import Graph, Op, PTensor
from chronotope.graph.rng import CounterRandom

# Models with more parameters than this are not run twice at capture (the time and memory
# of two more steps); ``capture(..., check_up_to=N)`` sets another bound, 0 none at all.
CHECK_UP_TO = 200_000_000
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}  # else (16-bit weights): 2e-2
_SHOWN = 6  # ops listed where the gradient may part


class CaptureMismatch(CaptureError):
    """The captured step computes other numbers than the model as written."""


def skipped(model: torch.nn.Module, tensors: Iterable[torch.Tensor], up_to: int | None) -> bool:
    """Whether the check does not run: turned off, a model above the bound, or one with
    no data (the meta device)."""
    params = list(model.parameters())
    if not up_to or sum(p.numel() for p in params) > up_to:
        return True
    return any(t.is_meta for t in (*params, *model.buffers(), *tensors))


def verify(graph: Graph, model: torch.nn.Module, run_model: Any,
           tensors: list[torch.Tensor], leaves: Mapping[str, torch.Tensor]) -> None:
    """Raise ``CaptureMismatch`` if ``graph`` on ``leaves`` (its inputs, parameters and
    buffers by name) computes another loss, other gradients or other buffer updates than
    ``run_model(*tensors)`` (the model as written, returning its loss). The model's buffers,
    gradients and torch's random state are as they were afterwards."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    held = [(m, n, b) for m in model.modules() for n, b in m._buffers.items()]
    before = {n: b.detach().clone() for n, b in model.named_buffers()}
    devices = sorted({t.device.index or 0 for t in (*params.values(), *tensors)
                      if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        try:
            with CounterRandom():
                eager_loss = run_model(*tensors)
            eager_buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
            eager_grads = _grads(eager_loss, params)
        finally:  # each buffer the same tensor as before (forward may rebind it), as it was
            for m, n, b in held:
                m._buffers[n] = b
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(before[n])
        torch.manual_seed(0)
        loss, updates = run_step(graph, leaves)
        grads = _grads(loss, params)
    problems = _compare_loss(graph, float(loss.detach()), float(eager_loss.detach()))
    problems += _compare_buffers(graph, updates, before, eager_buffers)
    if problems:
        raise CaptureMismatch("\n".join(problems))
    bad = _compare_grads(grads, eager_grads, params)
    if bad:
        raise CaptureMismatch(_gradient_report(graph, bad, eager_grads))


def _grads(loss: torch.Tensor, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """d loss / d each parameter (zeros where the loss does not depend on it), by a plain
    ``backward()`` as training calls it (a reentrant checkpoint allows no other); the
    parameters' own ``.grad`` are as they were afterwards."""
    held = {n: p.grad for n, p in params.items()}
    try:
        for p in params.values():
            p.grad = None
        if loss.requires_grad:
            loss.backward()
        return {n: torch.zeros_like(p) if p.grad is None else p.grad.detach()
                for n, p in params.items()}
    finally:
        for n, p in params.items():
            p.grad = held[n]


def _tolerance(dtype: torch.dtype) -> float:
    return _TOLERANCE.get(dtype, 2e-2)


def _relative(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """Largest difference over ``scale``; inf when only one of them is finite."""
    if a.shape != b.shape:
        return math.inf
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else math.inf
    diff = (a.double() - b.double()).abs()
    both = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)) or \
            not torch.equal(a[~both].double(), b[~both].double()):
        return math.inf
    return float(diff[both].max()) / scale if both.any() else 0.0


def _compare_loss(graph: Graph, loss: float, eager: float) -> list[str]:
    if _relative(torch.tensor(loss), torch.tensor(eager), max(abs(eager), 1e-12)) \
            <= _tolerance(graph.loss.dtype):
        return []
    return [f"{graph.name}: the captured step's loss is {loss:.6g} on the example batch, the "
            f"model's own is {eager:.6g}: capture followed something else than what forward "
            "computes. " + _REMEDY]


def _compare_buffers(graph: Graph, updates: Mapping[str, torch.Tensor],
                     before: Mapping[str, torch.Tensor],
                     eager: Mapping[str, torch.Tensor]) -> list[str]:
    problems = []
    for name, after in eager.items():
        captured = updates.get(name, before[name])
        scale = max(float(after.double().abs().max()) if after.numel() else 0.0, 1e-12)
        if _relative(captured, after, scale) <= _tolerance(after.dtype):
            continue
        how = "updates it" if name in updates else "leaves it as it was"
        problems.append(
            f"{graph.name}: forward changes buffer {name} differently from the captured step, "
            f"which {how} (largest difference {_relative(captured, after, scale):.1e} of its "
            f"largest value). " + _REMEDY)
    return problems


def _compare_grads(grads: Mapping[str, torch.Tensor], eager: Mapping[str, torch.Tensor],
                   params: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """The parameters whose gradient differs, with how much: the largest difference over
    the larger of that gradient's largest value and a hundredth of all gradients' (a
    gradient that is zero in exact arithmetic, as a bias before a batch norm's, is
    rounding noise either way)."""
    overall = max((float(g.double().abs().max()) for g in eager.values() if g.numel()),
                  default=0.0)
    bad = {}
    for name, ref in eager.items():
        local = float(ref.double().abs().max()) if ref.numel() else 0.0
        err = _relative(grads[name], ref, max(local, 1e-2 * overall, 1e-12))
        if not err <= _tolerance(params[name].dtype):
            bad[name] = err
    return bad


def _gradient_report(graph: Graph, bad: Mapping[str, float],
                     eager: Mapping[str, torch.Tensor]) -> str:
    worst = sorted(bad, key=lambda n: -bad[n])
    listed = ", ".join(f"{n} ({bad[n]:.1e})" for n in worst[:3])
    more = f" and {len(worst) - 3} more" if len(worst) > 3 else ""
    lines = [f"{graph.name}: the captured step's gradients differ from the model's own (eager "
             f"PyTorch) on the example batch: {listed}{more}, as the largest difference over "
             "the gradient's largest value."]
    suspects = _suspects(graph, set(bad), {n for n, g in eager.items()
                                           if n not in bad and bool(g.abs().max() > 0)})
    if suspects:
        first, rest = suspects[0], suspects[1:_SHOWN]
        lines.append(f"  The first op, back from the loss, where the gradient can part from "
                     f"eager's: {_describe(first)}")
        if rest:
            lines.append("  then: " + "; ".join(_describe(op) for op in rest)
                         + (" ..." if len(suspects) > _SHOWN else ""))
    lines.append("  " + _REMEDY)
    return "\n".join(lines)


_REMEDY = ("Wrap code capture cannot follow in a function registered with "
           "@chronotope.register_op (it then runs as written), and report the idiom; "
           "capture(..., check_up_to=0) skips this check.")


def _suspects(graph: Graph, bad: set[str], good: set[str]) -> list[Op]:
    """The ops through which the loss reaches a parameter with a wrong gradient but no
    parameter with a right one, nearest the loss first: the wrong gradient enters at one
    of them. (Without such ops: the readers of the wrong ones.)"""
    toward_loss = _ancestors(graph)
    def below(names: set[str]) -> set[Op]:
        reached = {graph.params[n] for n in names if n in graph.params}
        ops = set()
        for op in graph.ops:
            if any(t in reached for t in op.inputs) and op in toward_loss:
                ops.add(op)
                reached.update(op.outputs)
        return ops

    found = below(bad) - below(good)
    if not found:
        found = {op for op in graph.ops if any(t.name in bad for t in op.inputs)}
    return [op for op in reversed(graph.ops) if op in found]


def _ancestors(graph: Graph) -> set[Op]:
    """The ops the loss is computed from."""
    needed: set[PTensor] = {graph.loss}
    found = set()
    for op in reversed(graph.ops):
        if any(t in needed for t in op.outputs):
            found.add(op)
            needed.update(op.inputs)
    return found


def _describe(op: Op) -> str:
    where = f" at {op.source}" if op.source else ""
    return f"{op.name} ({op.kind}){where}"
