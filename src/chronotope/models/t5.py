"""T5-like encoder-decoder: one embedding shared three ways, relative position bias, RMS norm."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from chronotope.workload import Workload


@dataclass(frozen=True)
class T5Config:
    """Model shape plus the sizes of the example batch the factory builds."""

    vocab_size: int = 512
    d_model: int = 64
    d_kv: int = 16
    d_ffn: int = 256
    n_head: int = 4
    n_enc_layer: int = 2
    n_dec_layer: int = 2
    num_buckets: int = 32
    max_distance: int = 128
    norm_eps: float = 1e-6
    src_len: int = 32
    tgt_len: int = 16
    batch_size: int = 4


class T5LayerNorm(nn.Module):
    """T5's norm: scale by the root mean square, no mean subtraction and no bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RelativeBias(nn.Module):
    """Learned per-head bias indexed by the log-bucketed key-minus-query distance."""

    def __init__(self, cfg: T5Config, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = cfg.num_buckets, cfg.max_distance
        self.embedding = nn.Embedding(cfg.num_buckets, cfg.n_head)

    def bucket(self, rel: torch.Tensor) -> torch.Tensor:
        """Exact buckets for short distances, logarithmic ones up to max_distance."""
        n = self.num_buckets
        if self.bidirectional:
            n //= 2
            offset = (rel > 0).long() * n
            dist = rel.abs()
        else:  # a decoder query only sees keys at or before it
            offset = torch.zeros_like(rel)
            dist = (-rel).clamp(min=0)
        exact = n // 2
        log_ratio = torch.log(dist.clamp(min=1).float() / exact)
        log_ratio = log_ratio / math.log(self.max_distance / exact)
        far = (exact + (log_ratio * (n - exact)).long()).clamp(max=n - 1)
        return offset + torch.where(dist < exact, dist, far)

    def forward(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        q, k = torch.arange(q_len, device=device), torch.arange(k_len, device=device)
        rel = k[None, :] - q[:, None]
        return self.embedding(self.bucket(rel)).permute(2, 0, 1)[None]  # (1, H, Tq, Tk)


class Attention(nn.Module):
    """Multi-head attention without score scaling (T5 folds it into the init)."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.n_head, self.d_kv = cfg.n_head, cfg.d_kv
        inner = cfg.n_head * cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, mem: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        S = mem.shape[1]
        q = self.q(x).view(B, T, self.n_head, self.d_kv).transpose(1, 2)
        k = self.k(mem).view(B, S, self.n_head, self.d_kv).transpose(1, 2)
        v = self.v(mem).view(B, S, self.n_head, self.d_kv).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """ReLU feed-forward without biases."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.wi = nn.Linear(cfg.d_model, cfg.d_ffn, bias=False)
        self.wo = nn.Linear(cfg.d_ffn, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.relu(self.wi(x)))


class EncoderLayer(nn.Module):
    """Pre-norm self-attention and feed-forward."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.attn_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.attn(h, h, bias)
        return x + self.ffn(self.ffn_norm(x))


class DecoderLayer(nn.Module):
    """Pre-norm causal self-attention, cross-attention to the encoder, then feed-forward."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.self_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.cross_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.cross_attn = Attention(cfg)
        self.ffn_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, enc: torch.Tensor, self_bias: torch.Tensor) -> torch.Tensor:
        h = self.self_norm(x)
        x = x + self.self_attn(h, h, self_bias)
        x = x + self.cross_attn(self.cross_norm(x), enc, None)
        return x + self.ffn(self.ffn_norm(x))


class T5(nn.Module):
    """Encoder-decoder LM; forward returns the cross-entropy of the teacher-forced targets."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.d_model = cfg.d_model
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # One bias table per stack, shared by its layers (T5 stores it in the first layer).
        self.enc_bias = RelativeBias(cfg, bidirectional=True)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_enc_layer))
        self.enc_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)
        self.dec_bias = RelativeBias(cfg, bidirectional=False)
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_dec_layer))
        self.dec_norm = T5LayerNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        S, T = input_ids.shape[1], labels.shape[1]
        x = self.shared(input_ids)
        bias = self.enc_bias(S, S, x.device)
        for layer in self.encoder:
            x = layer(x, bias)
        enc = self.enc_norm(x)

        # Teacher forcing: the decoder reads the labels shifted right behind start token 0.
        y = self.shared(F.pad(labels[:, :-1], (1, 0), value=0))
        causal = torch.ones(T, T, dtype=torch.bool, device=y.device).tril()
        self_bias = self.dec_bias(T, T, y.device).masked_fill(~causal, torch.finfo(y.dtype).min)
        for layer in self.decoder:
            y = layer(y, enc, self_bias)
        logits = (self.dec_norm(y) * self.d_model**-0.5) @ self.shared.weight.t()  # tied head
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def t5(
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    **overrides: int | float,
) -> Workload:
    """Build a tiny T5 and a random (source, target) token batch."""
    cfg = replace(T5Config(), **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = T5(cfg)
    B = batch_size or cfg.batch_size
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, cfg.vocab_size, (B, cfg.src_len), generator=g)
    tgt = torch.randint(1, cfg.vocab_size, (B, cfg.tgt_len), generator=g)
    return Workload(model=model, inputs=(src.to(device), tgt.to(device)), name="t5")
