"""The example batch a training step is captured on, and the loss in a model's output."""

from __future__ import annotations

import inspect
import keyword
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from chronotope.errors import CaptureError


def model_loss(output: Any) -> Any:
    """The loss inside a model's output: itself, the first item, or the ``loss`` entry."""
    if isinstance(output, (torch.Tensor, fx.Proxy)):
        return output
    if isinstance(output, Mapping) or hasattr(output, "loss"):
        loss = output["loss"] if isinstance(output, Mapping) else output.loss
        if loss is None:
            raise CaptureError("the model returned no loss (loss is None); pass its labels "
                               "in the example batch, or pass loss_fn=")
        return loss
    if isinstance(output, (tuple, list)):
        return output[0]
    return output


@dataclass
class Batch:
    """The example batch, flattened: tensors become graph inputs, the rest stays constant."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    targets: tuple[Any, ...]

    @classmethod
    def of(cls, example_inputs: Any, kwargs: Mapping[str, Any] | None = None,
           targets: tuple[Any, ...] = ()) -> Batch:
        """Accept a tensor, a tuple of arguments, or a dict of keyword arguments."""
        kwargs = dict(kwargs or {})
        if isinstance(example_inputs, Mapping):
            example_inputs, kwargs = (), {**example_inputs, **kwargs}
        elif not isinstance(example_inputs, (tuple, list)):
            example_inputs = (example_inputs,)
        return cls(tuple(example_inputs), kwargs, tuple(targets))

    def tensors(self) -> list[torch.Tensor]:
        return [x for x in self.leaves()[0] if isinstance(x, torch.Tensor)]

    def leaves(self) -> tuple[list[Any], pytree.TreeSpec]:
        return pytree.tree_flatten((self.args, self.kwargs, self.targets))

    def tensor_names(self, model: nn.Module) -> list[str]:
        """Argument names for the tensor leaves, from the model's forward signature."""
        try:
            bound = inspect.signature(model.forward).bind_partial(*self.args).arguments
            arg_names = list(bound)
        except (TypeError, ValueError):
            arg_names = []
        arg_names += [f"arg{i}" for i in range(len(arg_names), len(self.args))]
        top = (
            list(zip(arg_names, self.args))
            + list(self.kwargs.items())
            + [("target" if i == 0 else f"target_{i}", t) for i, t in enumerate(self.targets)]
        )
        names: list[str] = []
        for name, value in top:
            if isinstance(value, torch.Tensor):
                names.append(name)
            else:
                n = sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value))
                names += [f"{name}_{i}" for i in range(n)]
        return identifiers(names)


def identifiers(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        n = re.sub(r"\W", "_", n)
        if not n or n[0].isdigit() or keyword.iskeyword(n) or n == "self":
            n = f"x_{n}"
        while n in out:
            n += "_"
        out.append(n)
    return out
