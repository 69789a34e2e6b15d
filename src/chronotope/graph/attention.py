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
from typing import Any

import torch
import torch.nn.functional as F

Region = Sequence[tuple[int, int]]


def causal_mask(rows: tuple[int, int], keys: int, device: Any) -> torch.Tensor:
    """``(hi - lo, keys)`` booleans: query row ``lo + i`` sees key ``j`` where ``j <= lo + i``."""
    lo, hi = rows
    return torch.arange(keys, device=device)[None, :] <= \
        torch.arange(lo, hi, device=device)[:, None]


def sliced_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False, *, region: Region) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of the query rows ``region[-2]`` of the whole op,
    keys and values whole; causal, without dropout (a dropout's form is ``rng.attention``).

    Its rows see the keys before them whole and the keys beside them causally: a mask
    aligned to the bottom right, which no kernel is handed as a tensor (one of rows x keys
    would be kept for the backward, as large as the scores)."""
    lo, hi = region[-2]
    end = min(hi, key.shape[-2])  # no row of this piece sees a key past its last row
    if lo == 0:  # top-left aligned, as torch's own is_causal
        return F.scaled_dot_product_attention(query, key[..., :end, :], value[..., :end, :],
                                              None, 0.0, True, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = (t.repeat_interleave(repeat, dim=-3) for t in (key, value))
    if query.device.type == "cpu" and end - lo == query.shape[-2] and \
            key.shape[-1] == value.shape[-1]:  # (what torch's CPU flash kernel takes)
        # in the dtype the attention would run in: autocast's, as for torch's own
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else \
            query.dtype
        query, key, value = (t.to(dtype) for t in (query, key, value))
        return _Blocks.apply(query, key, value, lo, end, scale)
    from torch.nn.attention.bias import causal_lower_right  # (it imports DTensor)

    return F.scaled_dot_product_attention(query, key[..., :end, :], value[..., :end, :],
                                          causal_lower_right(query.shape[-2], end), 0.0,
                                          False, scale=scale)


class _Blocks(torch.autograd.Function):
    """Attention over the keys before the rows (``:split``, all seen) and beside them
    (``split:end``, causal, square), each by the flash kernel, merged by their log-sum-exps;
    the backward runs each block's with the merged output and log-sum-exp, which need
    nothing of either block's own (as ring attention's backward does), and writes the keys'
    and values' gradients into one tensor of theirs, zeros past ``end``."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                split: int, end: int, scale: float | None) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(query, key[..., :split, :], value[..., :split, :], 0.0, False,
                       scale=scale)
        o2, l2 = flash(query, key[..., split:end, :], value[..., split:end, :], 0.0, True,
                       scale=scale)
        lse = torch.logaddexp(l1, l2)
        out = (o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]).to(
            query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.split, ctx.end, ctx.scale = split, end, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        s, e, grad = ctx.split, ctx.end, grad.contiguous()
        grad_key, grad_value = torch.zeros_like(key), torch.zeros_like(value)
        grad_query = None
        for keys, causal in ((slice(0, s), False), (slice(s, e), True)):
            q, k, v = backward(grad, query, key[..., keys, :], value[..., keys, :], out, lse,
                               0.0, causal, scale=ctx.scale)
            grad_query = q if grad_query is None else grad_query + q
            grad_key[..., keys, :] = k
            grad_value[..., keys, :] = v
        return grad_query, grad_key, grad_value, None, None, None


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
