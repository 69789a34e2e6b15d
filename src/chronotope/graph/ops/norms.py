"""Signatures of channel normalizations (batch, group and instance norm) and weight norm.

Batch norm in training mode normalizes with statistics over the whole batch.
A plan that splits the batch must still use the whole batch's statistics
(SyncBatchNorm), so capture rewrites the call into ops that have signatures:
per-channel sums over batch and spatial dims (a reduction, so a split leaves
partial sums the compiler adds up), the normalization, and the running
statistics' update, which then lands in the buffers exactly as on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from chronotope.graph.ops.pointwise import join, names
from chronotope.graph.ops.vision import channels
from chronotope.graph.registry import Emit, OpCall, OpRegistry

aten = torch.ops.aten

_DEFAULTS = {"weight": None, "bias": None, "running_mean": None, "running_var": None,
             "training": False, "use_input_stats": True, "momentum": 0.1, "eps": 1e-5}


@dataclass(frozen=True)
class BatchNormForm:
    """One spelling of batch norm: its argument names in order, what it returns (``out``:
    the output; ``saved``: output, batch mean and inverse deviation; ``functional``: those
    and the new running statistics), and whether it updates the running statistics in
    place."""

    args: tuple[str, ...]
    returns: str = "out"
    in_place: bool = True

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        return {**_DEFAULTS, **dict(zip(self.args, args)), **kwargs}


_NATIVE = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum",
           "eps")
FUNCTIONAL = BatchNormForm(("input", "running_mean", "running_var", "weight", "bias",
                            "training", "momentum", "eps"))
TORCH = BatchNormForm((*_NATIVE, "cudnn_enabled"))
NATIVE = BatchNormForm(_NATIVE, "saved")
NO_STATS = BatchNormForm(("input", "weight", "bias", "training", "momentum", "eps"), "saved",
                         in_place=False)
LEGIT_FUNCTIONAL = BatchNormForm(_NATIVE, "functional", in_place=False)
FUNCTIONAL_INSTANCE = BatchNormForm(("input", "running_mean", "running_var", "weight", "bias",
                                     "use_input_stats", "momentum", "eps"))


def batch_norm_eval(form: BatchNormForm | None):
    """Batch norm from running statistics: a per-channel affine map, so every dim splits.

    A training-mode call (``form``'s training flag set) is rewritten at capture
    (``batch_norm_train``) and gets no rule here.
    """

    def rule(call: OpCall) -> str | None:
        if form is not None and form.bind(call.args, call.kwargs)["training"]:
            return None
        x, *params = call.tensors
        dims = ["n", "c", *names(len(x.shape) - 2, "s")]
        outs = [dims] + [["c"] if o.shape == (x.shape[1],) else [str(s) for s in o.shape]
                         for o in call.outputs[1:]]
        return f"{join(dims, *(['c'] for _ in params))} -> {join(*outs)}"

    return rule


def batch_norm_train(form: BatchNormForm):
    """Training-mode batch norm as ops with signatures: ``mean = sum(x) / count``,
    ``var = sum((x - mean)^2) / count`` over batch and spatial dims, the normalized and
    scaled output, and ``running = (1 - momentum) * running + momentum * stat`` (the
    variance unbiased by ``count / (count - 1)``), as PyTorch updates them."""

    def rewrite(emit: Emit, args: tuple, kwargs: dict) -> tuple[Any, tuple] | None:
        a = form.bind(args, kwargs)
        x = a["input"]
        if not a["training"] or x.dim() < 2:
            return None
        out, mean, var, rstd = _normalize(emit, x, a["weight"], a["bias"], a["eps"])
        stats = (a["running_mean"], a["running_var"])
        if stats[0] is None or stats[1] is None:
            new: tuple = ()
        else:
            count = x.numel() // x.shape[1]
            momentum = a["momentum"]
            new = (_moving(emit, stats[0], mean, momentum, 1.0),
                   _moving(emit, stats[1], var, momentum, count / max(count - 1, 1)))
        result = {"out": out, "saved": (out, mean, rstd),
                  "functional": (out, mean, rstd, *new)}[form.returns]
        return result, (tuple(zip(stats, new)) if form.in_place else ())

    return rewrite


def _normalize(emit: Emit, x: Any, weight: Any, bias: Any, eps: float) -> tuple[Any, ...]:
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` with the batch's statistics."""
    dims = [0, *range(2, x.dim())]
    count = x.numel() // x.shape[1]
    shape = [1, x.shape[1], *[1] * (x.dim() - 2)]
    mean = emit(torch.div, emit(torch.sum, x, dims), count)
    centered = emit(torch.sub, x, emit(torch.reshape, mean, shape))
    var = emit(torch.div, emit(torch.sum, emit(torch.mul, centered, centered), dims), count)
    rstd = emit(torch.rsqrt, emit(torch.add, var, eps))
    out = emit(torch.mul, centered, emit(torch.reshape, rstd, shape))
    if weight is not None:
        out = emit(torch.mul, out, emit(torch.reshape, weight, shape))
    if bias is not None:
        out = emit(torch.add, out, emit(torch.reshape, bias, shape))
    return out, mean, var, rstd


def _moving(emit: Emit, running: Any, stat: Any, momentum: float, scale: float) -> Any:
    """``(1 - momentum) * running + momentum * scale * stat``; no gradient flows into it."""
    kept = emit(torch.mul, running, 1 - momentum)
    return emit(torch.add, kept, emit(torch.mul, emit(torch.detach, stat), momentum * scale))


def grouped_norm(input: torch.Tensor, group_size: int, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``group_norm`` over ``channels / group_size`` groups, so that a piece holding some
    whole groups is the same normalization over fewer."""
    return F.group_norm(input, input.shape[1] // group_size, weight, bias, eps)


def group_norm(grouped: bool):
    """``group_norm``: statistics per sample and group over the group's channels and all
    spatial dims, so the batch splits, and the groups in ``grouped_norm`` (other spellings
    pass a fixed group count, so their channels stay whole)."""

    def rule(call: OpCall) -> str | None:
        x, *params = call.tensors
        c = x.shape[1] if len(x.shape) > 1 else 0
        size = int(call.arg(1, "group_size" if grouped else "num_groups"))
        g = c // size if grouped else size
        if g < 1 or c % g:
            return None
        ch = channels(g, c // g, str(c // g)) if grouped and g > 1 else "c^"
        dims = ["n", ch, *(f"{d}^" for d in names(len(x.shape) - 2, "s"))]
        return f"{join(dims, *([ch] for _ in params))} -> {' '.join(dims)}"

    return rule


def regroup(emit: Emit, args: tuple, kwargs: dict) -> tuple[Any, tuple] | None:
    """A group norm of several groups as ``grouped_norm``, so its groups split."""
    a = {"weight": None, "bias": None, "eps": 1e-5,
         **dict(zip(("input", "num_groups", "weight", "bias", "eps"), args)), **kwargs}
    x, g = a["input"], int(a["num_groups"])
    if g <= 1 or x.dim() < 2:
        return None
    return emit(grouped_norm, x, x.shape[1] // g, a["weight"], a["bias"], a["eps"]), ()


def instance_norm(form: BatchNormForm):
    """``instance_norm``: statistics per sample and channel over the spatial dims, so batch and
    channels split (and spatial dims too when it normalizes with running statistics). Running
    statistics it would update in place (averaged over the batch) are not covered."""

    def rule(call: OpCall) -> str | None:
        a = form.bind(call.args, call.kwargs)
        own = a["use_input_stats"]
        if own and a["running_mean"] is not None:
            return None
        x, *params = call.tensors
        lead = ["n"] if len(x.shape) > 2 else []
        spatial = [f"{d}^" if own else d for d in names(len(x.shape) - len(lead) - 1, "s")]
        dims = [*lead, "c", *spatial]
        return f"{join(dims, *(['c'] for _ in params))} -> {' '.join(dims)}"

    return rule


def weight_norm(call: OpCall) -> str | None:
    """``_weight_norm(v, g, dim)``: ``v`` scaled to norm ``g`` over every dim but ``dim``, so
    only ``dim`` splits (``dim=-1``: the norm of all of ``v``)."""
    v, g = call.tensors[:2]
    n = len(v.shape)
    d = int(call.arg(2, "dim", 0))
    if d == -1 or len(g.shape) != n or n == 0:
        return None
    d %= n
    vs = ["w" if i == d else f"r{i}^" for i in range(n)]
    gs = ["w" if i == d else "1" for i in range(n)]
    outs = [vs] + [["w" if i == d else "1" for i in range(n)] for _ in call.outputs[1:]]
    return f"{join(vs, gs)} -> {join(*outs)}"


def register(reg: OpRegistry) -> None:
    forms = [([F.batch_norm], FUNCTIONAL), ([torch.batch_norm, aten.batch_norm], TORCH),
             ([aten.native_batch_norm, aten._native_batch_norm_legit], NATIVE),
             ([aten._native_batch_norm_legit.no_stats], NO_STATS),
             ([aten._native_batch_norm_legit_functional], LEGIT_FUNCTIONAL)]
    for targets, form in forms:
        reg.add(targets, "batch_norm", batch_norm_eval(form), decompose=batch_norm_train(form))
    reg.add([aten._native_batch_norm_legit_no_training], "batch_norm", batch_norm_eval(None))
    reg.add([F.group_norm, torch.group_norm, aten.group_norm], "group_norm", group_norm(False),
            decompose=regroup)
    reg.add([grouped_norm], "group_norm", group_norm(True))
    reg.add([torch._weight_norm, aten._weight_norm, aten._weight_norm_interface], "weight_norm",
            weight_norm)
    reg.add([F.instance_norm], "instance_norm", instance_norm(FUNCTIONAL_INSTANCE))
    reg.add([torch.instance_norm, aten.instance_norm], "instance_norm", instance_norm(
        BatchNormForm(("input", "weight", "bias", "running_mean", "running_var",
                       "use_input_stats", "momentum", "eps", "cudnn_enabled"))))
