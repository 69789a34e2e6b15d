"""Swin-like vision transformer: windowed attention, shifted windows, patch merging."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from chronotope.workload import Workload


@dataclass(frozen=True)
class SwinConfig:
    """Model shape plus the size of the example batch the factory builds."""

    img_size: int = 32
    patch_size: int = 2
    in_chans: int = 3
    embed_dim: int = 32
    depths: tuple[int, ...] = (2, 2)
    n_heads: tuple[int, ...] = (2, 4)
    window: int = 4
    mlp_ratio: int = 4
    num_classes: int = 10
    batch_size: int = 4


def window_partition(x: torch.Tensor, res: int, ws: int) -> torch.Tensor:
    """(B, res, res, C) -> (B * windows, ws * ws, C)."""
    C = x.shape[-1]
    x = x.view(-1, res // ws, ws, res // ws, ws, C).permute(0, 1, 3, 2, 4, 5)
    return x.contiguous().view(-1, ws * ws, C)


def window_reverse(x: torch.Tensor, res: int, ws: int) -> torch.Tensor:
    """(B * windows, ws * ws, C) -> (B, res, res, C); the inverse of window_partition."""
    C = x.shape[-1]
    x = x.view(-1, res // ws, res // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5)
    return x.contiguous().view(-1, res, res, C)


class WindowAttention(nn.Module):
    """Self-attention inside each window, with a learned relative position bias."""

    def __init__(self, dim: int, n_heads: int, ws: int) -> None:
        super().__init__()
        self.n_heads, self.scale = n_heads, (dim // n_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias_table = nn.Parameter(torch.randn((2 * ws - 1) ** 2, n_heads) * 0.02)
        # For each (query, key) pair of a window: row of bias_table holding their offset.
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij"))
        rel = coords.flatten(1)[:, :, None] - coords.flatten(1)[:, None, :] + ws - 1
        self.register_buffer("bias_index", rel[0] * (2 * ws - 1) + rel[1], persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        Bw, N, C = x.shape
        qkv = self.qkv(x).view(Bw, N, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn + self.bias_table[self.bias_index.view(-1)].view(N, N, -1).permute(2, 0, 1)
        if mask is not None:  # shifted block: forbid attention across the rolled-in seams
            n_win = mask.shape[0]
            attn = attn.view(-1, n_win, self.n_heads, N, N) + mask[None, :, None]
            attn = attn.view(-1, self.n_heads, N, N)
        y = attn.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(Bw, N, C))


class Block(nn.Module):
    """Pre-LN (shifted-)window attention plus MLP at a fixed resolution."""

    def __init__(self, dim: int, res: int, n_heads: int, ws: int, shift: int, mlp_ratio: int):
        super().__init__()
        self.res, self.ws, self.shift = res, ws, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, n_heads, ws)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)
        mask = None
        if shift:
            # Label the 3x3 regions the roll glues together; only same-region pairs may attend.
            r = torch.arange(res)
            band = (r >= res - ws).long() + (r >= res - shift).long()
            region = (band[:, None] * 3 + band[None, :])[None, :, :, None]
            win = window_partition(region, res, ws).squeeze(-1)
            same = win[:, None, :] == win[:, :, None]
            mask = torch.zeros(same.shape).masked_fill(~same, -100.0)
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        h = self.norm1(x).view(B, self.res, self.res, C)
        if self.shift:
            h = torch.roll(h, shifts=(-self.shift, -self.shift), dims=(1, 2))
        h = self.attn(window_partition(h, self.res, self.ws), self.attn_mask)
        h = window_reverse(h, self.res, self.ws)
        if self.shift:
            h = torch.roll(h, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + h.reshape(B, L, C)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PatchMerging(nn.Module):
    """Halve the resolution and double the width: concat each 2x2 neighbourhood, then project."""

    def __init__(self, dim: int, res: int) -> None:
        super().__init__()
        self.res = res
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, C = x.shape
        x = x.view(B, self.res, self.res, C)
        parts = (x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2])
        x = torch.cat(parts, dim=-1).view(B, -1, 4 * C)
        return self.reduction(self.norm(x))


class Swin(nn.Module):
    """Image classifier whose forward returns the cross-entropy against class labels."""

    def __init__(self, cfg: SwinConfig) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        self.patch_embed = nn.Linear(cfg.in_chans * p * p, cfg.embed_dim)
        self.patch_norm = nn.LayerNorm(cfg.embed_dim)
        layers: list[nn.Module] = []
        dim, res = cfg.embed_dim, cfg.img_size // p
        for i, (depth, heads) in enumerate(zip(cfg.depths, cfg.n_heads, strict=True)):
            if i > 0:
                layers.append(PatchMerging(dim, res))
                dim, res = 2 * dim, res // 2
            for j in range(depth):
                shift = cfg.window // 2 if j % 2 == 1 and res > cfg.window else 0
                layers.append(Block(dim, res, heads, cfg.window, shift, cfg.mlp_ratio))
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, p, n = images.shape[0], cfg.patch_size, cfg.img_size // cfg.patch_size
        # Patchify as a reshape + Linear: same maths as a stride-p convolution.
        x = images.view(B, cfg.in_chans, n, p, n, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_norm(self.patch_embed(x.reshape(B, n * n, -1)))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x).mean(dim=1))
        return F.cross_entropy(logits, labels)


def swin(
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    **overrides: object,
) -> Workload:
    """Build a tiny Swin and a batch of random images with random class labels."""
    cfg = replace(SwinConfig(), **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Swin(cfg)
    B = batch_size or cfg.batch_size
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(B, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g)
    labels = torch.randint(0, cfg.num_classes, (B,), generator=g)
    return Workload(model=model, inputs=(images.to(device), labels.to(device)), name="swin")
