"""What a capture needs: a model, an example batch, and how the loss is formed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from chronotope.errors import ChronotopeError


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

    def replica(self, replicas: int) -> Workload:
        """One replica's rows of the example batch (the first ``1 / replicas`` of every
        tensor), to capture the graph a plan scaled to ``replicas`` (``plan.scale``) is
        made on."""
        leaves = [t for t in pytree.tree_leaves((self.inputs, self.kwargs, self.targets))
                  if isinstance(t, torch.Tensor) and t.dim()]
        rows = leaves[0].shape[0] if leaves else 0
        if rows % replicas:
            raise ChronotopeError(f"{self.name}: a batch of {rows} rows does not split into "
                                  f"{replicas} replicas; choose a batch size they divide")
        part = rows // replicas

        def cut(t: Any) -> Any:
            return t[:part] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows \
                else t
        inputs, kwargs, targets = pytree.tree_map(cut, (self.inputs, self.kwargs, self.targets))
        return replace(self, inputs=inputs, kwargs=kwargs, targets=targets)
