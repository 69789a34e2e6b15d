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
    keys and values whole; causal, without dropout (a dropout's form is ``rng.attention``)."""
    lo, hi = region[-2]
    end = min(hi, key.shape[-2])  # no row of this piece sees a key past its last row
    key, value = key[..., :end, :], value[..., :end, :]
    if lo == 0:  # top-left aligned, as torch's own is_causal
        return F.scaled_dot_product_attention(query, key, value, None, dropout_p, True,
                                              scale=scale, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(query, key, value, causal_mask((lo, hi), end,
                                                                         query.device),
                                          dropout_p, False, scale=scale, enable_gqa=enable_gqa)


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
