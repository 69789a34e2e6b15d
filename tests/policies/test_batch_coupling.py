"""Losses and layers that couple the samples of a batch train like one device under every
batch-splitting plan.

A contrastive loss (``logits = a @ b.t()``, cross entropy along both axes), a batch
centring, a softmax over the batch: each makes ops whose pieces read value shares of what
a replicated piece holds whole, or keep only a slice of a replica's gradient. Random
small models mix such ops with per-sample ones; every one must equal one device.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import chronotope as ct
from chronotope.policies import ParallelConfig, make
from tests.policies.plan_testing import trains_like_one_device

B, D = 4, 8

# Per-sample layers, and layers that mix the samples of the batch.
LAYERS = {
    "linear": lambda m, h: m.next_linear()(h),
    "tanh": lambda m, h: torch.tanh(h),
    "center": lambda m, h: h - h.mean(0, keepdim=True),
    "gram": lambda m, h: torch.tanh(h @ h.t() / D) @ h / B,  # bounded: training stays finite
    "softmax_batch": lambda m, h: torch.softmax(h, dim=0) * B,
    "normalize": lambda m, h: F.normalize(h, dim=-1),
}

# Losses from two towers' outputs a, b (both B x D) and labels t.
LOSSES = {
    "clip": lambda a, b, t: (F.cross_entropy(a @ b.t(), t) + F.cross_entropy((a @ b.t()).t(), t))
    / 2,
    "cross_only": lambda a, b, t: F.cross_entropy((a @ b.t()).t(), t),
    "mse_gram": lambda a, b, t: F.mse_loss(torch.tanh(a @ a.t()), torch.tanh(b @ b.t())),
    "batch_std": lambda a, b, t: (a - b).std(0).sum(),
    "logsumexp_batch": lambda a, b, t: torch.logsumexp(a * b, dim=0).mean(),
}


class TwoTowers(nn.Module):
    def __init__(self, layers: list[str], loss: str, frozen: bool = False) -> None:
        super().__init__()
        self.layers, self.loss = layers, loss
        count = 2 * (1 + layers.count("linear"))
        self.linears = nn.ModuleList(nn.Linear(D, D) for _ in range(count))
        self._next = 0
        if frozen:
            self.linears[0].requires_grad_(False)

    def next_linear(self) -> nn.Module:
        self._next += 1
        return self.linears[self._next - 1]

    def tower(self, h: torch.Tensor) -> torch.Tensor:
        h = self.next_linear()(h)
        for name in self.layers:
            h = LAYERS[name](self, h)
        return h

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self._next = 0
        t = torch.arange(x.shape[0])
        return LOSSES[self.loss](self.tower(x), self.tower(y), t)


def workload(layers: list[str], loss: str, seed: int = 0, frozen: bool = False) -> ct.Workload:
    """In float64: stacked batch-coupling layers (two gram matrices, then a batch std) turn
    float32's reordered sums into differences above 1e-5 (2.5e-5 for tp, 4.5e-14 in
    float64), while a wrong plan is off by far more than float64's rounding."""
    torch.manual_seed(seed)
    model = TwoTowers(layers, loss, frozen).double()
    x, y = (torch.randn(B, D, dtype=torch.float64) for _ in range(2))
    return ct.Workload(model, (x, y), name="two-towers")


POLICIES = {
    "dp": ParallelConfig("dp", 2),
    "zero2": ParallelConfig("zero-2", 2),
    "tp": ParallelConfig("tp", 2),
    "dp-micro": ParallelConfig("dp-tp", 2, tp=1, micro=2),
}


def check(w: ct.Workload, policy: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    trains_like_one_device(w, ct.compile(make(graph, POLICIES[policy])), steps=2)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_contrastive_loss_trains_like_one_device(policy):
    """The symmetric CLIP loss: the transposed term's gradient was halved under dp."""
    check(workload(["normalize"], "clip"), policy)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.lists(st.sampled_from(list(LAYERS)), max_size=3),
       loss=st.sampled_from(list(LOSSES)), policy=st.sampled_from(list(POLICIES)),
       seed=st.integers(0, 3))
def test_random_batch_coupled_models_train_like_one_device(layers, loss, policy, seed):
    check(workload(layers, loss, seed), policy)
