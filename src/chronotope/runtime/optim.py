"""The optimizer every rank runs over its parameter regions, and its learning-rate schedule.

One description serves the ranks, the single-device reference and a user's own
PyTorch loop (``build`` on ``model.parameters()``, ``set_lr`` each step), so all
three train with the same groups and rates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class Optim:
    """Which optimizer, its hyper-parameters and schedule (picklable, for workers).

    Weight decay skips 1-D parameters (biases, norm scales) unless ``decay_all``: a
    region of a parameter has the parameter's number of dims, so every rank groups
    its regions as one device groups the whole parameters.
    """

    name: str = "sgd"
    lr: float = 0.1
    weight_decay: float = 0.0
    clip: float | None = None  # max global gradient norm, as torch.nn.utils.clip_grad_norm_
    schedule: str = "constant"  # or "cosine": from lr down to min_lr over the run
    warmup: int = 0  # steps of linear warmup to lr
    min_lr: float = 0.0
    decay_all: bool = False
    momentum: float = 0.0  # sgd
    betas: tuple[float, float] = (0.9, 0.999)  # adamw

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adamw"):
            raise ValueError(f"unknown optimizer {self.name!r}: use sgd or adamw")
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.schedule!r}: use "
                             f"{' or '.join(LR_SCHEDULES)}")

    def build(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        decayed = [p for p in params if self.decay_all or p.ndim >= 2]
        plain = [p for p in params if not (self.decay_all or p.ndim >= 2)]
        groups = [{"params": ps, "weight_decay": wd} for ps, wd in
                  ((decayed, self.weight_decay), (plain, 0.0)) if ps]
        if self.name == "sgd":
            return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum)
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)

    def lr_at(self, step: int, steps: int) -> float:
        """The learning rate of step ``step`` (from 0) of a run of ``steps``."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup) / max(1, steps - self.warmup))
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def set_lr(self, optimizer: torch.optim.Optimizer, step: int, steps: int) -> float:
        lr = self.lr_at(step, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
