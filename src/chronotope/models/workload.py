"""What a capture needs: a model, an example batch, and how the loss is formed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Workload:
    """A model with an example batch.

    The training step is ``loss = loss_fn(model(*inputs, **kwargs), *targets)``;
    without ``loss_fn`` the model's own output is the loss (a scalar tensor, or
    the first element / ``"loss"`` entry of a tuple, dict or ``ModelOutput``).
    """

    model: nn.Module
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    targets: tuple[Any, ...] = ()
    loss_fn: Callable[..., torch.Tensor] | None = None
    name: str = "model"
