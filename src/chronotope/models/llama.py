"""Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, untied head."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from chronotope.errors import UnknownModelError
from chronotope.workload import Workload


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape plus the size of the example batch the factory builds."""

    vocab_size: int = 512
    seq_len: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    d_model: int = 64
    d_ffn: int = 176
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    batch_size: int = 4


# Llama 2 70B (Touvron et al. 2023); Llama 3 70B (Meta, 2024: a 128K vocabulary, 8K
# sequences, rope theta 500,000).
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "llama-70b": LlamaConfig(32000, 4096, 80, 64, 8, 8192, 28672, batch_size=8),
    "llama3-70b": LlamaConfig(128256, 8192, 80, 64, 8, 8192, 28672, rope_theta=500000.0,
                              batch_size=8),
}


class RMSNorm(nn.Module):
    """Scale-only normalisation by the root mean square (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout: pairs are (x[i], x[i + d/2])."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query attention: each key/value head is shared by n_head / n_kv_head queries."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ffn, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ffn, bias=False)
        self.down = nn.Linear(cfg.d_ffn, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm residual block."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only LM whose forward returns the next-token cross-entropy."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        head_dim = cfg.d_model // cfg.n_head
        inv_freq = cfg.rope_theta ** -(torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(cfg.seq_len).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        # Derived from the config, so not saved in a checkpoint.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def llama(
    *,
    preset: str = "tiny",
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    **overrides: int | float,
) -> Workload:
    """Build a Llama preset and a random next-token batch (targets are inputs shifted by one)."""
    if preset not in PRESETS:
        raise UnknownModelError(f"unknown Llama preset {preset!r}; presets: {', '.join(PRESETS)}")
    cfg = replace(PRESETS[preset], **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Llama(cfg)
    B = batch_size or cfg.batch_size
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len + 1), generator=g).to(device)
    inputs = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return Workload(model=model, inputs=inputs, name="llama" if preset == "tiny" else preset)
