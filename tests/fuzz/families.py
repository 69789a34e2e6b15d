"""The model families plans are drawn for: the built-ins from their tiniest configs, small
models written here that are not transformers, the zoo's CNN (convolutions, batch
norm with running statistics, pooling), one model of everyday idioms (a custom
Function, no_grad, writes into slices, random draws in place, buffers forward changes,
an unused head), and routed experts.

Each family is captured once and trained once on one device per step count; every plan
drawn for it is compared with that run.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.graph.experts import routed_experts
from chronotope.models import get_workload
from chronotope.runtime.local import Optim, RunResult
from chronotope.runtime.reference import train_reference
from tests.zoo.models import cnn_bn

OPTIM = Optim("sgd", 0.1)
BATCH = 4

# Config overrides that make each built-in as small as it goes: one or two layers, a
# width of 16, sequences of 8.
TINY: dict[str, dict[str, object]] = {
    "gpt": dict(n_layer=1, d_model=16, n_head=2, vocab_size=32, block_size=8),
    "llama": dict(n_layer=1, d_model=16, n_head=2, n_kv_head=1, d_ffn=32, vocab_size=32,
                  seq_len=8),
    "bert": dict(n_layer=1, d_model=16, n_head=2, d_ffn=32, vocab_size=32, seq_len=8),
    "t5": dict(n_enc_layer=1, n_dec_layer=1, d_model=16, d_kv=8, n_head=2, d_ffn=32,
               vocab_size=32, src_len=8, tgt_len=4),
    "swin": dict(img_size=8, patch_size=2, embed_dim=8, depths=(1,), n_heads=(2,), window=2,
                 mlp_ratio=2, num_classes=4),
    "evoformer": dict(n_seq=2, n_res=4, c_m=8, c_z=4, n_block=1, n_recycle=1, batch_size=2),
    "hf-gpt2": dict(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, seq_len=8),
    "hf-bert": dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                    intermediate_size=32, vocab_size=32, max_position_embeddings=16,
                    seq_len=8),
}


class Towers(nn.Module):
    """Two MLP towers over a shared, frozen input projection, with dropout, meeting in a
    similarity matrix: no attention, no normalization layer, a loss over the whole batch."""

    def __init__(self, features: int = 8, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.embed.requires_grad_(False)
        self.query = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.25),
                                   nn.Linear(width, width))
        self.doc = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(),
                                 nn.Linear(2 * width, width))
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        a = self.query(self.embed(q))
        b = self.doc(self.embed(d))
        a = a - a.mean(0, keepdim=True)  # centred over the batch
        return self.temperature * F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).t()


def clip_loss(logits: torch.Tensor) -> torch.Tensor:
    """Each query picks its document and each document its query (CLIP's symmetric loss)."""
    t = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, t) + F.cross_entropy(logits.t(), t)) / 2


def towers(seed: int = 0) -> ct.Workload:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    q, d = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 8, generator=g)
    return ct.Workload(Towers(), (q, d), loss_fn=clip_loss, name="towers")


class Mixer(nn.Module):
    """An MLP-Mixer-like regressor: token mixing across a transposed axis, channel mixing,
    a frozen output bias, and a squared error plus a penalty on the batch's mean output."""

    def __init__(self, tokens: int = 6, channels: int = 8) -> None:
        super().__init__()
        self.tokens = nn.Linear(tokens, tokens)
        self.channels = nn.Linear(channels, 2 * channels)
        self.out = nn.Linear(2 * channels, 1)
        self.shift = nn.Parameter(torch.linspace(-1, 1, tokens), requires_grad=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x + self.tokens(x.transpose(1, 2)).transpose(1, 2)
        h = F.silu(self.channels(h))
        pred = self.out(h).squeeze(-1) + self.shift
        return F.mse_loss(pred, y) + pred.mean(0).pow(2).sum() * 0.1


def mixer(seed: int = 0) -> ct.Workload:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(BATCH, 6, 8, generator=g), torch.randn(BATCH, 6, generator=g)
    return ct.Workload(Mixer(), (x, y), name="mixer")


class Reverse(torch.autograd.Function):
    """Gradient reversal: the identity forward, the negated gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return -0.5 * g


class Idioms(nn.Module):
    """Everyday idioms in one small model: a custom autograd Function, a statistic under
    ``torch.no_grad()``, writes into slices of a clone and of a ``new_empty`` tensor, a
    drop path drawn in place, a counter and a moving average kept in buffers, and a head
    forward never calls."""

    def __init__(self, features: int = 8, width: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.first = nn.Parameter(torch.randn(width) * 0.1)
        self.left = nn.Linear(width, width // 2)
        self.right = nn.Linear(width, width - width // 2)
        self.out = nn.Linear(width, 1)
        self.unused = nn.Linear(width, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = Reverse.apply(torch.tanh(self.inp(x)))
        with torch.no_grad():
            scale = h.abs().amax(-1, keepdim=True) + 1
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        h = (h / scale).clone()
        h[:, 0] += self.first[0]
        z = h.new_empty(h.shape)
        z[..., : h.shape[-1] // 2].copy_(self.left(h))
        z[..., h.shape[-1] // 2:].copy_(self.right(h))
        keep = z.new_empty(z.shape[0], 1).bernoulli_(0.75)
        self.steps += 1
        return F.mse_loss(self.out(F.relu(z) * keep / 0.75).squeeze(-1), y)


class Experts(nn.Module):
    """A top-2 router over four routed experts (gate and up apart), beside a dense MLP:
    the experts one op whose tokens and experts both split."""

    def __init__(self, features: int = 8, experts: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(features, experts, bias=False)
        self.gate = nn.Parameter(torch.randn(experts, hidden, features) / features ** 0.5)
        self.up = nn.Parameter(torch.randn(experts, hidden, features) / features ** 0.5)
        self.down = nn.Parameter(torch.randn(experts, features, hidden) / hidden ** 0.5)
        self.dense = nn.Linear(features, features)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        routed = routed_experts(x, index, weights, self.gate, self.up, self.down, 0, "silu")
        return F.mse_loss((routed + self.dense(x)).sum(-1), y)


def experts(seed: int = 0) -> ct.Workload:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(BATCH * 2, 8, generator=g), torch.randn(BATCH * 2, generator=g)
    return ct.Workload(Experts(), (x, y), name="experts")


def idioms(seed: int = 0) -> ct.Workload:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, generator=g)
    return ct.Workload(Idioms(), (x, y), name="idioms")


def _builtin(name: str) -> Callable[[], ct.Workload]:
    return lambda: get_workload(name, **{"batch_size": BATCH, **TINY[name]})


FAMILIES: dict[str, Callable[[], ct.Workload]] = {
    **{name: _builtin(name) for name in TINY}, "towers": towers, "mixer": mixer,
    "cnn": lambda: cnn_bn(batch_size=BATCH), "idioms": idioms, "experts": experts}


@functools.cache
def family(name: str) -> tuple[ct.Workload, ct.Graph]:
    """The family's workload and its captured graph (captured once per process)."""
    workload = FAMILIES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return workload, ct.capture(workload)


@functools.cache
def reference(name: str, steps: int) -> RunResult:
    """The family trained on one device for ``steps`` steps, every plan's yardstick."""
    return train_reference(family(name)[0], steps, OPTIM)
