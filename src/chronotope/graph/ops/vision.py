"""Signatures of vision ops: convolutions, pooling, resampling and pixel rearrangements.

A window that slides over a spatial dim reads its neighbours (a halo), so a
plain slice of that dim does not compute a slice of the output: spatial dims
are frozen. Batch and channels split; a convolution's input channels are its
reduction (``k+``), so a split there leaves partial sums, and a grouped one's
groups split too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from chronotope.graph.ops.pointwise import join, names
from chronotope.graph.registry import Emit, OpCall, OpRegistry

aten = torch.ops.aten


def channels(groups: int, per_group: int, name: str) -> str:
    """A channel axis of ``groups`` runs of ``per_group``: only the group index splits
    when there are several groups, since one run's share is not a contiguous slice."""
    if groups == 1:
        return name
    return "g" if per_group == 1 else f"(g {name})"


@dataclass(frozen=True)
class ConvForm:
    """One spelling of a convolution: its arguments after ``(input, weight, bias)``, and
    whether it is transposed (None: its ``transposed`` argument says)."""

    args: tuple[str, ...]
    transposed: bool | None

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        return {"bias": None, "groups": 1, "transposed": self.transposed,
                **dict(zip(("input", "weight", "bias", *self.args), args)), **kwargs}


CONV = ConvForm(("stride", "padding", "dilation", "groups"), False)
CONV_TRANSPOSE = ConvForm(("stride", "padding", "output_padding", "groups", "dilation"), True)
CONVOLUTION = ConvForm(("stride", "padding", "dilation", "transposed", "output_padding",
                        "groups"), None)
GROUPED = ConvForm(("group_size", "transposed"), None)
_PASSED = {False: ("stride", "padding", "dilation"),
           True: ("stride", "padding", "output_padding", "dilation")}
_CONVS = {False: (F.conv1d, F.conv2d, F.conv3d),
          True: (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)}


def grouped_conv(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int, transposed: bool, **kwargs: Any) -> torch.Tensor:
    """A grouped convolution over ``channels / group_size`` groups, so that a piece holding
    some whole groups (of the input, weight and bias) is the same convolution over fewer."""
    spatial = weight.dim() - 2
    conv = _CONVS[transposed][spatial - 1]
    return conv(input, weight, bias, groups=input.shape[-spatial - 1] // group_size, **kwargs)


def conv(form: ConvForm):
    """A convolution: ``x (n, k, *s), w (o, k / g, *kernel) -> (n, o, *t)`` (a transposed
    weight is ``(k, o / g, *kernel)``); the bias is additive under a split of ``k``. With
    groups, the group index splits only in ``grouped_conv`` (a piece's group count there
    follows its channels); other spellings pass a fixed count, so their groups stay whole.
    """

    def rule(call: OpCall) -> str | None:
        x, w, *bias = call.tensors
        a = form.bind(call.args, call.kwargs)
        spatial = len(w.shape) - 2
        if spatial < 1 or len(x.shape) not in (spatial + 1, spatial + 2):
            return None
        cin = x.shape[-spatial - 1]
        g = cin // int(a["group_size"]) if form is GROUPED else int(a["groups"])
        cout = w.shape[1] * g if a["transposed"] else w.shape[0]
        if g < 1 or cin % g or cout % g:
            return None
        k_in, k_out = cin // g, cout // g
        if g > 1 and form is not GROUPED:
            x_ch, o_ch, w_dims = "k^", "o^", ["w0^", "w1^"]
        else:
            x_ch, o_ch = channels(g, k_in, "k+"), channels(g, k_out, "o")
            if a["transposed"]:  # weight (k, o / g, *kernel)
                w_dims = [x_ch, "o" if k_out > 1 or g == 1 else "1"]
            else:  # weight (o, k / g, *kernel)
                w_dims = [o_ch, "k+" if k_in > 1 or g == 1 else "1"]
        batch = ["n"] if len(x.shape) == spatial + 2 else []
        xs = [f"{d}^" for d in names(spatial, "s")]
        ks = [f"{d}^" for d in names(spatial, "r")]
        ts = [f"{d}^" for d in names(spatial, "t")]
        ins = [[*batch, x_ch, *xs], [*w_dims, *ks]] + [[o_ch] for _ in bias]
        return f"{join(*ins)} -> {' '.join([*batch, o_ch, *ts])}"

    return rule


def regroup(form: ConvForm):
    """A grouped convolution as ``grouped_conv``, so its groups split."""

    def rewrite(emit: Emit, args: tuple, kwargs: dict) -> tuple[Any, tuple] | None:
        a = form.bind(args, kwargs)
        g, x = int(a["groups"]), a["input"]
        if g <= 1:
            return None
        transposed = bool(a["transposed"])
        passed = {k: a[k] for k in _PASSED[transposed] if k in a}
        group_size = x.shape[-(a["weight"].dim() - 2) - 1] // g
        return emit(grouped_conv, x, a["weight"], a["bias"], group_size, transposed,
                    **passed), ()

    return rewrite


def windowed(spatial: int | None):
    """Pooling and resampling: each output position of a channel reads a window of that
    channel's spatial dims, so leading dims (batch, channels) split and spatial ones do
    not. ``spatial``: how many trailing dims are spatial (None: all but batch and
    channels). Every output (values, a max pool's indices) has the output's dims."""

    def rule(call: OpCall) -> str:
        x = call.tensors[0]
        n = len(x.shape)
        s = n - 2 if spatial is None else spatial
        lead = names(n - s, "b")
        ins = [*lead, *(f"{d}^" for d in names(s, "s"))]
        outs = [[*lead, *(f"{d}^" for d in names(len(o.shape) - len(lead), "t"))]
                for o in call.outputs]
        return f"{' '.join(ins)} -> {join(*outs)}"

    return rule


def _window(value: int | list[int] | tuple[int, ...]) -> int:
    """Elements in a 2-D window (``kernel_size`` as one int or a pair)."""
    if isinstance(value, int):
        return value * value
    return value[0] * value[1]


def im2col(call: OpCall) -> str:
    """``F.unfold``: each window's channels side by side, ``(n, c, h, w) -> (n, c * k, l)``:
    the channels still lead, so they split."""
    x = call.tensors[0]
    lead = ["n"] if len(x.shape) == 4 else []
    k = _window(call.arg(1, "kernel_size"))
    return f"{' '.join([*lead, 'c', 's0^', 's1^'])} -> {' '.join([*lead, f'(c {k})', 'l^'])}"


def col2im(call: OpCall) -> str:
    """``F.fold``: windows summed back into an image, ``(n, c * k, l) -> (n, c, h, w)``."""
    x = call.tensors[0]
    lead = ["n"] if len(x.shape) == 3 else []
    k = _window(call.arg(2, "kernel_size"))
    return f"{' '.join([*lead, f'(c {k})', 'l^'])} -> {' '.join([*lead, 'c', 't0^', 't1^'])}"


def pixel_shuffle(down: bool):
    """``pixel_shuffle`` moves runs of ``r * r`` channels into an ``r x r`` block of pixels
    (``pixel_unshuffle`` back): leading dims and the channel groups split."""

    def rule(call: OpCall) -> str:
        x = call.tensors[0]
        r = int(call.arg(1, "downscale_factor" if down else "upscale_factor"))
        lead = names(len(x.shape) - 3, "b")
        packed = [*lead, f"(c {r} {r})", "t0^", "t1^"]
        spread = [*lead, "c", "s0^", "s1^"]
        ins, out = (spread, packed) if down else (packed, spread)
        return f"{' '.join(ins)} -> {' '.join(out)}"

    return rule


def targets(*names_: str) -> list[object]:
    """The targets of these names in torch.nn.functional, torch, torch._C._nn and aten."""
    found: list[object] = []
    for name in names_:
        for ns in (F, torch, torch._C._nn, aten):
            target = getattr(ns, name, None)
            if target is not None and target not in found:
                found.append(target)
    return found


def register(reg: OpRegistry) -> None:
    forms = [(targets(*(f"conv{d}d" for d in (1, 2, 3))), CONV, "conv"),
             (targets(*(f"conv_transpose{d}d" for d in (1, 2, 3))), CONV_TRANSPOSE,
              "conv_transpose"),
             (targets("convolution", "_convolution"), CONVOLUTION, "conv")]
    for found, form, kind in forms:
        reg.add(found, kind, conv(form), additive_inputs=(2,), decompose=regroup(form))
    reg.add([grouped_conv], "conv", conv(GROUPED), additive_inputs=(2,))
    for d in (1, 2, 3):
        pools = [f"max_pool{d}d", f"max_pool{d}d_with_indices", f"avg_pool{d}d",
                 f"adaptive_avg_pool{d}d", f"_adaptive_avg_pool{d}d", f"adaptive_max_pool{d}d",
                 f"adaptive_max_pool{d}d_with_indices", f"lp_pool{d}d"]
        reg.add(targets(*pools), "pool", windowed(d))
    resampling = ["interpolate", "upsample", "upsample_nearest", "upsample_bilinear"] + [
        f"{prefix}{kind}" for prefix in ("upsample_", "_upsample_")
        for kind in ("nearest1d", "nearest2d", "nearest3d", "linear1d", "bilinear2d",
                     "bicubic2d", "trilinear3d", "nearest_exact1d", "nearest_exact2d",
                     "nearest_exact3d", "bilinear2d_aa", "bicubic2d_aa")]
    reg.add(targets(*resampling), "interpolate", windowed(None))
    reg.add([F.unfold, torch._C._nn.im2col, aten.im2col], "unfold", im2col)
    reg.add([F.fold, torch._C._nn.col2im, aten.col2im], "fold", col2im)
    reg.add(targets("pixel_shuffle"), "pixel_shuffle", pixel_shuffle(down=False))
    reg.add(targets("pixel_unshuffle"), "pixel_unshuffle", pixel_shuffle(down=True))
