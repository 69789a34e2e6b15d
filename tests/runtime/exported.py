"""A model that ``torch.export`` captures into aten ops: pooling and a top-k router."""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.models import Workload


class PoolRouter(nn.Module):
    """A conv stem with max-pooling, then a top-2 of 3 experts router (MoE-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.gate = nn.Linear(16, 3)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 3)

    def forward(self, x, y):
        h = F.max_pool2d(torch.relu(self.conv(x)), 4).flatten(1)
        weights, chosen = torch.topk(torch.softmax(self.gate(h), -1), 2, dim=-1)
        mixed = sum((chosen == e).any(-1, keepdim=True) * expert(h)
                    for e, expert in enumerate(self.experts))
        return F.cross_entropy(self.head(mixed * weights.sum(-1, keepdim=True)), y)


def exported() -> tuple[Workload, ct.Graph]:
    torch.manual_seed(0)
    w = Workload(PoolRouter(), (torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops without signatures: replicated, as they may be
        return w, ct.capture(w, frontend="export")
