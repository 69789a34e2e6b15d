"""GPT-2 style decoder: the reference dense transformer workload, from tiny to GPT-3 175B."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from chronotope.errors import UnknownModelError
from chronotope.workload import Workload


@dataclass(frozen=True)
class GPTConfig:
    """Model shape plus the size of the example batch the factory builds."""

    vocab_size: int = 512
    block_size: int = 32
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    batch_size: int = 4
    # False: attention written out (scores, causal mask, softmax, values), as it ran before
    # fused kernels; its scores are a tensor of sequence x sequence per head
    flash: bool = True


# Sizes from the GPT-3 paper (Brown et al. 2020, table 2.1); 13B uses d=5120 so heads divide it.
# 39B is the size automatic-search papers report on (48 layers of 8192, sequence 1024).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "gpt3-1.3b": GPTConfig(50257, 2048, 24, 16, 2048, batch_size=8),
    "gpt3-13b": GPTConfig(50257, 2048, 40, 40, 5120, batch_size=8),
    "gpt3-39b": GPTConfig(51200, 1024, 48, 64, 8192, batch_size=8),
    "gpt3-175b": GPTConfig(50257, 2048, 96, 96, 12288, batch_size=8),
}


class CausalSelfAttention(nn.Module):
    """Multi-head attention with one fused qkv projection, as in GPT-2."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.flash = cfg.flash
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd = C // self.n_head
        # Sizes come from the projection's output, so a tensor-parallel shard of it
        # (fewer heads) runs through the same code.
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q = q.view(B, T, -1, hd).transpose(1, 2)
        k = k.view(B, T, -1, hd).transpose(1, 2)
        v = v.view(B, T, -1, hd).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
            y = F.dropout(scores.softmax(dim=-1), p, self.training) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """The 4x GELU feed-forward."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN residual block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only LM whose forward returns the next-token cross-entropy."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, so the tied-parameter path is exercised
        # GPT-2 init: N(0, 0.02), residual projections scaled down by depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt(
    *,
    preset: str = "tiny",
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    **overrides: int | float,
) -> Workload:
    """Build a GPT preset and a random next-token batch (targets are inputs shifted by one)."""
    if preset not in PRESETS:
        raise UnknownModelError(f"unknown GPT preset {preset!r}; presets: {', '.join(PRESETS)}")
    cfg = replace(PRESETS[preset], **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(cfg)
    B = batch_size or cfg.batch_size
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, cfg.block_size + 1), generator=g).to(device)
    inputs = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return Workload(model=model, inputs=inputs, name="gpt" if preset == "tiny" else preset)
