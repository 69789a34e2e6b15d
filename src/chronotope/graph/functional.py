"""Out-of-place forms of in-place tensor updates, so captured graphs are in SSA form."""

from __future__ import annotations

from typing import Any

import torch

# In-place methods whose out-of-place form broadcasts the other operands to ``x``.
ELEMENTWISE_UPDATES = frozenset({"copy_", "fill_", "zero_"})


def setitem(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """``x[index] = value`` without touching ``x``."""
    y = x.clone()
    y[index] = value
    return y


def updated(x: torch.Tensor, method: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``x.<method>(*args)`` (an in-place method such as ``copy_``) applied to a copy of ``x``."""
    y = x.clone()
    getattr(y, method)(*args, **kwargs)
    return y


def through(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value``, with ``x``'s gradient passing straight through: ``x`` written in place
    under ``torch.no_grad()``, which autograd does not record."""
    return value.detach() + (x - x.detach())


def loss_denominator(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """What a mean-reduced cross entropy divides by: the (weighted) count of counted labels."""
    keep = target != ignore_index
    if weight is None:
        return keep.sum(dtype=dtype)
    return torch.where(keep, weight[target.clamp(min=0)], 0).sum(dtype=dtype)
