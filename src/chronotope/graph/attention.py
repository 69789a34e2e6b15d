"""Causal attention cut along its queries: each piece masks by where its rows sit.

``F.scaled_dot_product_attention(..., is_causal=True)`` lets query ``i`` see keys
``j <= i``. A piece holding query rows ``[lo, hi)`` of the whole op (context
parallelism, sequence parallelism through attention) is the same op over those rows
with the mask moved by ``lo``; it also never needs keys past ``hi``, so it computes
over ``[0, hi)`` alone, which is what makes a causal query split unbalanced unless
the rows are dealt out in a zigzag (``policies/context.py``). The generated code calls
``sliced_attention`` for such a piece with its box of the output (``region``), as it
passes a random op its box (``graph/rng.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

Region = Sequence[tuple[int, int]]


def causal_mask(rows: tuple[int, int], keys: int, device: Any) -> torch.Tensor:
    """``(hi - lo, keys)`` booleans: query row ``lo + i`` sees key ``j`` where ``j <= lo + i``."""
    lo, hi = rows
    return torch.arange(keys, device=device)[None, :] <= \
        torch.arange(lo, hi, device=device)[:, None]


class Arriving(Protocol):
    """Keys and values that come a run at a time (ring attention's blocks): the runs of
    their sequence in the order they arrive, this device's own first, and a wait until
    one is in place in the tensors the piece was given. A piece says which runs it reads;
    its backward gives the gradients of each run to ``leave`` (which sends another
    device's on as the backward goes, and sums this one's), where that takes them."""

    def runs(self) -> list[tuple[int, int]]: ...

    def wait(self, run: int) -> None: ...

    def read(self, piece: Any, runs: Sequence[int]) -> None: ...

    def leave(self, piece: Any, run: int, grads: Sequence[torch.Tensor]) -> bool: ...


def sliced_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False, *, region: Region,
                     arriving: Arriving | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of the query rows ``region[-2]`` of the whole op,
    keys and values whole; without dropout (a dropout's form is ``rng.attention``).

    Causal rows see the keys before them whole and the keys beside them causally: a mask
    aligned to the bottom right, which no kernel is handed as a tensor (one of rows x keys
    would be kept for the backward, as large as the scores). With ``arriving`` the keys
    and values come a run at a time (context parallelism's ring): each run the rows see is
    attended to as soon as it is in place, merged with the others by log-sum-exp."""
    lo, hi = region[-2]
    keys = key.shape[-2]
    end = min(hi, keys) if is_causal else keys  # no causal row sees a key past its last row
    if arriving is not None:
        runs = _ring_runs(arriving.runs(), (lo, hi), end, is_causal)
        piece = tuple(region)
        if attn_mask is None and runs is not None:
            query, groups = _ready(query, key, enable_gqa)
            return _Runs.apply(query, key, value, tuple(r for r, _ in runs), scale, groups,
                               arriving, tuple(i for _, i in runs), piece)
        for i in range(len(arriving.runs())):  # a mask, or runs not aligned to the rows
            arriving.wait(i)
        key, value = _Whole.apply(key, value, arriving, piece)
    if not is_causal:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, False,
                                              scale=scale, enable_gqa=enable_gqa)
    if lo == 0:  # top-left aligned, as torch's own is_causal
        return F.scaled_dot_product_attention(query, key[..., :end, :], value[..., :end, :],
                                              None, 0.0, True, scale=scale,
                                              enable_gqa=enable_gqa)
    if query.device.type == "cpu" and end - lo == query.shape[-2] and \
            key.shape[-1] == value.shape[-1]:  # (what torch's CPU flash kernel takes)
        query, groups = _ready(query, key, enable_gqa)
        return _Runs.apply(query, key, value, ((0, lo, False), (lo, end, True)), scale, groups)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = (t.repeat_interleave(repeat, dim=-3) for t in (key, value))
    from torch.nn.attention.bias import causal_lower_right  # (it imports DTensor)

    return F.scaled_dot_product_attention(query, key[..., :end, :], value[..., :end, :],
                                          causal_lower_right(query.shape[-2], end), 0.0,
                                          False, scale=scale)


def _ring_runs(runs: list[tuple[int, int]], rows: tuple[int, int], end: int, causal: bool,
               ) -> list[tuple[tuple[int, int, bool], int]] | None:
    """The key runs query ``rows`` see, in the order they arrive, each with whether it is
    the causal square beside the rows and its index among ``runs``; None when a run is
    cut by the rows' causal edge other than there (the pieces then wait for every run)."""
    lo, hi = rows
    out = []
    for i, (a, b) in enumerate(runs):
        if a >= end:
            continue  # after the rows' last: never seen
        if not causal or b <= lo + 1:
            out.append(((a, b, False), i))
        elif (a, b) == (lo, hi):
            out.append(((a, b, True), i))
        else:
            return None
    return out


def _ready(query: torch.Tensor, key: torch.Tensor, enable_gqa: bool
           ) -> tuple[torch.Tensor, int]:
    """The query in the dtype the attention would run in (autocast's, as torch's own), and
    how many of its heads share one of the keys' (GQA)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        query = query.to(torch.get_autocast_dtype(device))
    groups = query.shape[-3] // key.shape[-3] if enable_gqa and key.dim() > 2 else 1
    return query, groups


def _block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
           scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` over one block of keys (causal: the square beside its rows)
    and its rows' log-sum-exps: torch's flash kernel on CPU, plain matmuls elsewhere."""
    if query.device.type == "cpu" and key.shape[-1] == value.shape[-1]:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, scale=scale)
    scores = _scores(query, key, causal, scale)
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp() @ value.float()).to(query.dtype), lse


def _block_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                    scale: float | None) -> tuple[torch.Tensor, ...]:
    """The gradients of one block's query, keys and values, given the output and
    log-sum-exps of the rows over every block: each block's share of the softmax."""
    if query.device.type == "cpu" and key.shape[-1] == value.shape[-1]:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, out, lse, 0.0, causal, scale=scale)
    factor = _factor(query, scale)
    p = (_scores(query, key, causal, scale) - lse[..., None]).exp()
    g = grad.float()
    dp = g @ value.float().transpose(-1, -2)
    ds = p * (dp - (g * out.float()).sum(-1, keepdim=True))
    return ((ds @ key.float() * factor).to(query.dtype),
            (ds.transpose(-1, -2) @ query.float() * factor).to(key.dtype),
            (p.transpose(-1, -2) @ g).to(value.dtype))


def _factor(query: torch.Tensor, scale: float | None) -> float:
    """The scores' scale: ``scale``, or one over the root of the head size (sdpa's)."""
    return scale if scale is not None else query.shape[-1] ** -0.5


def _scores(query: torch.Tensor, key: torch.Tensor, causal: bool, scale: float | None
            ) -> torch.Tensor:
    scores = query.float() @ key.float().transpose(-1, -2) * _factor(query, scale)
    if causal:
        rows, keys = scores.shape[-2:]
        scores = scores.masked_fill(~causal_mask((keys - rows, keys), keys, scores.device),
                                    float("-inf"))
    return scores


class _Runs(torch.autograd.Function):
    """Attention over runs of keys ``(lo, hi, causal)`` one block each, merged by their
    log-sum-exps (ring attention's online softmax), each waited for as it arrives; the
    backward runs each block's with the merged output and log-sum-exp, which need
    nothing of a block's own, and writes the keys' and values' gradients into one tensor
    of theirs, zeros where no run is.

    The keys and values are kept on the context, not saved: their runs from other
    devices land in them after a piece read its own (a saved tensor written after it was
    saved is refused by autograd)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                runs: tuple[tuple[int, int, bool], ...], scale: float | None, groups: int,
                arriving: Arriving | None = None, indices: tuple[int, ...] = (),
                piece: Any = None) -> torch.Tensor:
        merged: tuple[torch.Tensor, torch.Tensor] | None = None  # output (fp32), lse
        for k, (lo, hi, causal) in enumerate(runs):
            if arriving is not None:
                arriving.wait(indices[k])
            o, l_ = _block(query, _block_of(key, lo, hi, groups, query.dtype),
                           _block_of(value, lo, hi, groups, query.dtype), causal, scale)
            if merged is None:
                merged = o.float(), l_
                continue
            before, seen = merged
            lse = torch.logaddexp(seen, l_)
            merged = (before * (seen - lse).exp()[..., None] +
                      o.float() * (l_ - lse).exp()[..., None], lse)
        assert merged is not None  # (a piece sees its own rows' keys)
        out, lse = merged[0].to(query.dtype), merged[1]
        ctx.save_for_backward(query, out, lse)
        ctx.key, ctx.value, ctx.runs, ctx.scale, ctx.groups = key, value, runs, scale, groups
        ctx.arriving, ctx.indices, ctx.piece = arriving, indices, piece
        if arriving is not None:
            arriving.read(piece, indices)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, out, lse = ctx.saved_tensors
        key, value = ctx.key, ctx.value
        grad = grad.contiguous()
        grad_key = grad_value = None  # made where a run's gradient does not leave
        grad_query = None
        g, arriving = ctx.groups, ctx.arriving
        for k_, (lo, hi, causal) in enumerate(ctx.runs):
            q, k, v = _block_backward(grad, query, _block_of(key, lo, hi, g, query.dtype),
                                      _block_of(value, lo, hi, g, query.dtype), out, lse,
                                      causal, ctx.scale)
            grad_query = q if grad_query is None else grad_query + q
            k, v = _shared(k, g), _shared(v, g)
            run = ctx.indices[k_] if arriving is not None else None
            if run is None or not arriving.leave(ctx.piece, run, (k, v)):
                if grad_key is None or grad_value is None:
                    grad_key, grad_value = torch.zeros_like(key), torch.zeros_like(value)
                grad_key[..., lo:hi, :] = k
                grad_value[..., lo:hi, :] = v
        return (grad_query, _or_zeros(grad_key, key), _or_zeros(grad_value, value), None, None,
                None, None, None, None)


class _Whole(torch.autograd.Function):
    """Keys and values as they are, read whole by a ring attention's piece that cannot
    take them run by run (a mask): in the backward, the gradients of the runs other
    devices own leave from here, as ``_Runs`` gives them."""

    @staticmethod
    def forward(ctx: Any, key: torch.Tensor, value: torch.Tensor, arriving: Arriving,
                piece: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.arriving, ctx.piece = arriving, piece
        ctx.runs, ctx.like = arriving.runs(), (key, value)
        arriving.read(piece, range(len(ctx.runs)))
        return key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad_key: torch.Tensor | None, grad_value: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        grad_key, grad_value = (torch.zeros_like(t) if g is None else g
                                for g, t in zip((grad_key, grad_value), ctx.like))
        for run, (lo, hi) in enumerate(ctx.runs):
            ctx.arriving.leave(ctx.piece, run, (grad_key[..., lo:hi, :],
                                                grad_value[..., lo:hi, :]))
        return grad_key, grad_value, None, None


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``grad``, or zeros shaped like ``like`` that take no memory (every run's gradient
    left: nothing reads this one)."""
    return grad if grad is not None else like.new_zeros(()).expand(like.shape)


def _block_of(t: torch.Tensor, lo: int, hi: int, groups: int, dtype: torch.dtype
              ) -> torch.Tensor:
    """Keys or values ``lo:hi`` with each head given to the ``groups`` query heads that
    share it, in the query's dtype."""
    block = t[..., lo:hi, :]
    return (block.repeat_interleave(groups, dim=-3) if groups > 1 else block).to(dtype)


def _shared(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """A block's gradient of its query heads' keys or values, summed per shared head."""
    if groups == 1:
        return grad
    return grad.unflatten(-3, (grad.shape[-3] // groups, groups)).sum(-3)


def is_causal(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``scaled_dot_product_attention`` (or its forms) is causal."""
    return bool(kwargs["is_causal"] if "is_causal" in kwargs else
                args[5] if len(args) > 5 else False)


def visible(rows: tuple[int, int], keys: int) -> float:
    """The share of the ``(rows, keys)`` query-key pairs a causal mask keeps."""
    lo, hi = rows
    full = max(lo, min(hi, keys - 1))  # rows from here on see every key
    seen = (full - lo) * (lo + full + 1) / 2 + (hi - full) * keys  # row i < full sees i + 1
    return seen / max(1, (hi - lo) * keys)
