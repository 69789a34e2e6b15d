"""Signatures of elementwise ops, reductions and normalizations."""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.nn.functional as F

from chronotope.graph import functional
from chronotope.graph.registry import OpCall, OpRegistry, method

aten = torch.ops.aten


def names(n: int, prefix: str = "d") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def join(*tensors: list[str]) -> str:
    if len(tensors) == 1 and not tensors[0]:
        return "()"  # a lone 0-dim tensor
    return ", ".join(" ".join(t) for t in tensors)


def pointwise(call: OpCall) -> str:
    """Broadcasting elementwise op: dims align from the right; a broadcast dim is ``1``."""
    out = call.out.shape
    onames = names(len(out))
    items = []
    for t in call.tensors:
        offset = len(out) - len(t.shape)
        if offset < 0:
            return None  # type: ignore[return-value]  # not a broadcast: unknown op shape
        items.append(
            ["1" if s == 1 and out[offset + j] != 1 else onames[offset + j]
             for j, s in enumerate(t.shape)]
        )
    outs = ", ".join(" ".join(onames) for _ in call.outputs)
    return f"{join(*items)} -> {outs}"


def _dims_arg(value: object, ndim: int) -> list[int] | None:
    """Normalize a ``dim`` argument (int, sequence, or None meaning all)."""
    if value is None:
        return None
    if isinstance(value, int):
        return [value % ndim] if ndim else []
    return [int(d) % ndim for d in value]  # type: ignore[union-attr]


def reduction(marker: str, dim_index: int = 1, keepdim_index: int = 2):
    """Rule for ``op(x, dim=None, keepdim=False)``; reduced dims get ``marker``."""

    def rule(call: OpCall) -> str | None:
        x = call.tensors[0]
        ndim = len(x.shape)
        dim = call.arg(dim_index, "dim")
        if isinstance(dim, torch.Size | tuple | list) and len(dim) == 0:
            dim = None
        if hasattr(dim, "shape"):  # torch.max(x, other): elementwise
            return pointwise(call)
        dims = _dims_arg(dim, ndim)
        reduced = set(range(ndim)) if dims is None else set(dims)
        keep = bool(call.arg(keepdim_index, "keepdim", False)) and dims is not None
        inp = [f"d{i}{marker}" if i in reduced else f"d{i}" for i in range(ndim)]
        out = [("1" if keep else None) if i in reduced else f"d{i}" for i in range(ndim)]
        out_s = " ".join(o for o in out if o is not None)
        return f"{' '.join(inp)} -> " + ", ".join(out_s for _ in call.outputs)

    return rule


def along_dim(dim_index: int = 1, default: int | None = None):
    """An op that keeps the shape but mixes values along one dim (softmax, cumsum)."""

    def rule(call: OpCall) -> str | None:
        x = call.tensors[0]
        dim = call.arg(dim_index, "dim", default)
        if dim is None:
            return None
        d = dim % len(x.shape)
        dims = [f"d{i}^" if i == d else f"d{i}" for i in range(len(x.shape))]
        return f"{' '.join(dims)} -> {' '.join(dims)}"

    return rule


def normalized(shape_index: int, n_params: int):
    """layer_norm / rms_norm: the trailing normalized dims are frozen everywhere."""

    def rule(call: OpCall) -> str:
        x = call.tensors[0]
        k = len(call.arg(shape_index, "normalized_shape"))
        n = len(x.shape)
        dims = [f"d{i}^" if i >= n - k else f"d{i}" for i in range(n)]
        params = [dims[n - k:] for _ in call.tensors[1 : 1 + n_params]]
        return f"{join(dims, *params)} -> {' '.join(dims)}"

    return rule


def loss(call: OpCall, target_index: int = 1, reduction_index: int | None = None) -> str:
    """nll / cross entropy: ``input (N, C, *d)``, class targets ``(N, *d)``."""
    x, target = call.tensors[0], call.tensors[1]
    red = call.arg(reduction_index or 99, "reduction", "mean")
    red = {0: "none", 1: "mean", 2: "sum"}.get(red, red)
    n = len(x.shape)
    if n == 1:
        inp = ["c^"]
    else:
        inp = ["n", "c^", *names(n - 2, "s")]
    tgt = [d for d in inp if d != "c^"] if len(target.shape) == n - 1 else inp
    extra = [["c^"] for _ in call.tensors[2:]]  # class weights
    if red == "none":
        out = " ".join(tgt if len(target.shape) == n - 1 else [d for d in inp if d != "c^"])
        return f"{join(inp, tgt, *extra)} -> {out}"
    red_dims = [d for d in inp if d != "c^"]
    inp = [d + "+" if d in red_dims else d for d in inp]
    tgt = [d + "+" if d in red_dims else d for d in tgt]
    return f"{join(inp, tgt, *extra)} -> "


UNARY = [
    "abs", "neg", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sigmoid", "tanh", "relu",
    "sin", "cos", "erf", "reciprocal", "floor", "ceil", "round", "sign", "square", "logical_not",
    "bitwise_not", "isnan", "isinf", "exp2", "trunc", "clamp", "clip", "clamp_min", "clamp_max",
    "nan_to_num", "float", "half", "bfloat16", "double", "long", "int", "bool", "to", "type",
    "contiguous", "clone", "detach", "cpu", "cuda", "requires_grad_", "positive",
    "real", "imag", "conj", "conj_physical", "resolve_conj", "angle",
]
BINARY = [
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow",
    "rsub", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
    "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "atan2",
    "masked_fill", "where", "lerp", "addcmul", "addcdiv", "type_as", "hypot", "xlogy",
    "fill", "copy", "zero", "zeros_like", "ones_like", "full_like", "empty_like", "rand_like",
    "randn_like", "alias", "lift_fresh_copy", "_to_copy", "scalar_tensor", "sub_", "dropout",
    "silu", "gelu", "softplus", "mish", "elu", "leaky_relu", "hardtanh", "logsigmoid",
    "relu6", "hardswish", "hardsigmoid", "selu", "celu", "threshold", "feature_dropout",
    "polar", "complex",
]
OPERATORS = [
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.pos, operator.and_, operator.or_,
    operator.xor, operator.invert, operator.lt, operator.le, operator.gt, operator.ge,
    operator.eq, operator.ne, operator.abs,
]
ACTIVATIONS = [
    F.gelu, F.silu, F.relu, F.relu6, F.elu, F.selu, F.celu, F.leaky_relu, F.hardtanh,
    F.softplus, F.mish, F.logsigmoid, F.hardswish, F.hardsigmoid, F.tanh, F.sigmoid,
    F.dropout, F.alpha_dropout, F.threshold,
]


# Inputs each op is (jointly) linear in: it may be cut along their values (ct.ValueSplit).
LINEAR = {"add": (0, 1), "sub": (0, 1), "mul": (0,), "div": (0,), "true_divide": (0,),
          "truediv": (0,), "neg": (0,)}


PRODUCTS = frozenset({"mul"})  # linear in each factor with the other held


def register(reg: OpRegistry) -> None:
    for name in sorted(set(UNARY + BINARY)):
        targets: list[object] = method(name)
        for ns in (torch, aten):
            if hasattr(ns, name):
                targets.append(getattr(ns, name))
        reg.add(targets, name.strip("_"), pointwise, linear_inputs=LINEAR.get(name, ()),
                linear_each=name in PRODUCTS)
    for fn in OPERATORS:
        name = fn.__name__.strip("_")
        reg.add([fn], name, pointwise, linear_inputs=LINEAR.get(name, ()),
                linear_each=name in PRODUCTS)
    for name in ("__and__", "__or__", "__xor__", "__invert__", "__rsub__", "__radd__"):
        targets = [*method(name), *([getattr(aten, name)] if hasattr(aten, name) else [])]
        reg.add(targets, name.strip("_"), pointwise)
    for fn in ACTIVATIONS:
        reg.add([fn], fn.__name__, pointwise)
    reg.add([functional.through], "through", pointwise, linear_inputs=(0, 1))

    reg.add([torch.sum, *method("sum"), aten.sum], "sum", reduction("+"))
    reg.add([torch.mean, *method("mean"), aten.mean], "mean", reduction("+"),
            mean_reduction=True)
    for name in ("amax", "amin", "max", "min", "prod", "all", "any", "argmax", "argmin",
                 "logsumexp", "count_nonzero", "norm", "var", "std"):
        targets = [*method(name), *(getattr(ns, name) for ns in (torch, aten)
                                    if hasattr(ns, name))]
        reg.add(targets, name, reduction("^"))

    for name in ("softmax", "log_softmax", "cumsum", "cumprod", "_softmax", "_log_softmax"):
        targets = [*method(name), *(getattr(ns, name) for ns in (torch, aten)
                                    if hasattr(ns, name))]
        reg.add(targets, name.strip("_"), along_dim())
    reg.add([F.softmax], "softmax", along_dim())
    reg.add([F.log_softmax], "log_softmax", along_dim())
    reg.add([F.normalize], "normalize", along_dim(2, default=1))

    reg.add([F.layer_norm, torch.layer_norm, aten.layer_norm], "layer_norm", normalized(1, 2))
    reg.add([F.rms_norm, torch.rms_norm, aten.rms_norm], "rms_norm", normalized(1, 1))

    losses: list[tuple[list[Any], str, int]] = [  # where each takes its reduction
        ([F.cross_entropy], "cross_entropy", 7),
        ([torch._C._nn.cross_entropy_loss, aten.cross_entropy_loss], "cross_entropy", 3),
        ([F.nll_loss], "nll_loss", 6), ([aten.nll_loss, aten.nll_loss_nd], "nll_loss", 3)]
    for targets, kind, at in losses:
        reg.add(targets, kind, functools.partial(loss, reduction_index=at), mean_reduction=True,
                reduction_index=at)
    reg.add([functional.loss_denominator], "loss_denominator", _denominator)
    reg.add([F.mse_loss, F.l1_loss, F.smooth_l1_loss], "pointwise_loss", _pointwise_loss,
            mean_reduction=True, reduction_index=4)
    reg.add([F.binary_cross_entropy_with_logits, F.binary_cross_entropy], "pointwise_loss",
            functools.partial(_pointwise_loss, reduction_index=5), mean_reduction=True,
            reduction_index=5)


def _denominator(call: OpCall) -> str:
    """Counting labels: a sum over all of them; class weights are read whole."""
    dims = [d + "+" for d in names(len(call.tensors[0].shape))]
    weight = [["c^"]] if len(call.tensors) > 1 else []
    return f"{join(dims, *weight)} -> "


def _pointwise_loss(call: OpCall, reduction_index: int = 4) -> str:
    """An elementwise loss of an input and a target (and weights broadcast to them), summed
    or averaged over every dim unless ``reduction="none"``."""
    red = call.arg(reduction_index, "reduction", "mean")
    n = len(call.tensors[0].shape)
    dims = names(n)
    items = [["1" if s == 1 and call.tensors[0].shape[n - len(t.shape) + j] != 1
              else dims[n - len(t.shape) + j] for j, s in enumerate(t.shape)]
             for t in call.tensors]
    if red == "none":
        return f"{join(*items)} -> {' '.join(dims)}"
    return f"{join(*[[d if d == '1' else d + '+' for d in item] for item in items])} -> "
