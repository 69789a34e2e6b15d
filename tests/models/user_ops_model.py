"""A user's model file registering its own op, loaded as ``tests/models/user_ops_model.py:make``.

Worker processes cannot import this file by a module name: they load it by its path.
"""

import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct


@ct.register_op("b d, d -> b d")
def clipped_scale(x, w):
    """Reads a tensor value in Python: untraceable unless it is one registered op."""
    if x.abs().max() > 100:
        x = x.clamp(-100, 100)
    return x * w


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.out = nn.Linear(8, 1)

    def forward(self, x, y):
        return F.mse_loss(self.out(clipped_scale(torch.tanh(self.fc(x)), self.scale)), y)


def make(batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batch_size, 4, generator=g), torch.randn(batch_size, 1, generator=g)
    return Scaled(), (x, y)
