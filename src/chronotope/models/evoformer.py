"""Evoformer (protein structure trunk): an MSA and a pair representation that update each other.

The workload stresses what language models do not: 4-D activations, attention
along either axis of a 2-D grid, einsum contractions over a third residue, and
recycling passes that reuse the previous output without backpropagating into it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from chronotope.workload import Workload

N_AA = 22  # residue classes of the target features (20 amino acids, unknown, gap)
N_MSA = 23  # residue classes of an MSA column (adds the mask token)


@dataclass(frozen=True)
class EvoformerConfig:
    """Model shape plus the size of the example batch the factory builds."""

    n_seq: int = 4  # MSA depth S
    n_res: int = 8  # residues R
    target_dim: int = N_AA
    msa_dim: int = 49  # one-hot residue plus deletion and profile features
    c_m: int = 16
    c_z: int = 8
    n_head_msa: int = 2
    msa_head_dim: int = 8
    n_head_pair: int = 2
    pair_head_dim: int = 4
    c_opm: int = 4  # outer-product-mean width; its c x c products feed the pair
    c_mul: int = 8  # triangle-multiplication width
    transition_n: int = 4
    max_relpos: int = 32
    n_block: int = 2
    n_recycle: int = 3
    n_bins: int = 8
    batch_size: int = 2


class GatedAttention(nn.Module):
    """Sigmoid-gated multi-head attention along dim -2 of ``(B, N, L, c)``, with an optional bias.

    Scores are written out (matmul + softmax) rather than fused, because the bias
    is 5-D and the gate multiplies the attended values before the output projection.
    """

    def __init__(self, c_in: int, n_head: int, head_dim: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim
        inner = n_head * head_dim
        self.q = nn.Linear(c_in, inner, bias=False)
        self.k = nn.Linear(c_in, inner, bias=False)
        self.v = nn.Linear(c_in, inner, bias=False)
        self.g = nn.Linear(c_in, inner)
        self.o = nn.Linear(inner, c_in)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        B, N, L, _ = x.shape
        H, D = self.n_head, self.head_dim
        q = self.q(x).view(B, N, L, H, D).transpose(2, 3)
        k = self.k(x).view(B, N, L, H, D).transpose(2, 3)
        v = self.v(x).view(B, N, L, H, D).transpose(2, 3)
        a = (q * D**-0.5) @ k.transpose(-1, -2)  # (B, N, H, L, L)
        if bias is not None:
            a = a + bias
        o = (a.softmax(dim=-1) @ v).transpose(2, 3).reshape(B, N, L, H * D)
        return self.o(torch.sigmoid(self.g(x)) * o)


class MSARowAttention(nn.Module):
    """Each MSA row attends over residues; the pair representation biases the scores."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.norm_m = nn.LayerNorm(cfg.c_m)
        self.norm_z = nn.LayerNorm(cfg.c_z)
        self.bias = nn.Linear(cfg.c_z, cfg.n_head_msa, bias=False)
        self.attn = GatedAttention(cfg.c_m, cfg.n_head_msa, cfg.msa_head_dim)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        bias = self.bias(self.norm_z(z)).permute(0, 3, 1, 2)[:, None]  # (B, 1, H, R, R)
        return self.attn(self.norm_m(m), bias)


class MSAColumnAttention(nn.Module):
    """Each residue column attends over the sequences of the MSA."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.c_m)
        self.attn = GatedAttention(cfg.c_m, cfg.n_head_msa, cfg.msa_head_dim)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        return self.attn(self.norm(m).transpose(1, 2)).transpose(1, 2)


class Transition(nn.Module):
    """Position-wise two-layer ReLU MLP, ``n`` times wider inside."""

    def __init__(self, c: int, n: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.fc1 = nn.Linear(c, n * c)
        self.fc2 = nn.Linear(n * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(self.norm(x))))


class OuterProductMean(nn.Module):
    """MSA -> pair: the outer product of residues i and j's features, averaged over sequences."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.c_m)
        self.a = nn.Linear(cfg.c_m, cfg.c_opm)
        self.b = nn.Linear(cfg.c_m, cfg.c_opm)
        self.out = nn.Linear(cfg.c_opm * cfg.c_opm, cfg.c_z)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        B, S, R, _ = m.shape
        m = self.norm(m)
        o = torch.einsum("bsic,bsjd->bijcd", self.a(m), self.b(m)) / S
        return self.out(o.reshape(B, R, R, -1))


class TriangleMultiplication(nn.Module):
    """Pair update from the edges of triangles ijk: outgoing ``ik, jk`` or incoming ``ki, kj``."""

    def __init__(self, cfg: EvoformerConfig, outgoing: bool) -> None:
        super().__init__()
        self.equation = "bikc,bjkc->bijc" if outgoing else "bkic,bkjc->bijc"
        self.norm_in = nn.LayerNorm(cfg.c_z)
        self.a_proj = nn.Linear(cfg.c_z, cfg.c_mul)
        self.a_gate = nn.Linear(cfg.c_z, cfg.c_mul)
        self.b_proj = nn.Linear(cfg.c_z, cfg.c_mul)
        self.b_gate = nn.Linear(cfg.c_z, cfg.c_mul)
        self.norm_out = nn.LayerNorm(cfg.c_mul)
        self.out = nn.Linear(cfg.c_mul, cfg.c_z)
        self.gate = nn.Linear(cfg.c_z, cfg.c_z)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = self.norm_in(z)
        a = torch.sigmoid(self.a_gate(z)) * self.a_proj(z)
        b = torch.sigmoid(self.b_gate(z)) * self.b_proj(z)
        x = torch.einsum(self.equation, a, b)
        return torch.sigmoid(self.gate(z)) * self.out(self.norm_out(x))


class TriangleAttention(nn.Module):
    """Pair row ``i`` attends over ``k`` with bias from edge ``jk`` (starting node).

    The ending-node variant is the same computation on the transposed pair.
    """

    def __init__(self, cfg: EvoformerConfig, starting: bool) -> None:
        super().__init__()
        self.starting = starting
        self.norm = nn.LayerNorm(cfg.c_z)
        self.bias = nn.Linear(cfg.c_z, cfg.n_head_pair, bias=False)
        self.attn = GatedAttention(cfg.c_z, cfg.n_head_pair, cfg.pair_head_dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if not self.starting:
            z = z.transpose(1, 2)
        z = self.norm(z)
        bias = self.bias(z).permute(0, 3, 1, 2)[:, None]  # (B, 1, H, J, K)
        out = self.attn(z, bias)
        return out if self.starting else out.transpose(1, 2)


class EvoformerBlock(nn.Module):
    """MSA stack, then the MSA -> pair communication, then the pair stack; all residual."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.row_attn = MSARowAttention(cfg)
        self.col_attn = MSAColumnAttention(cfg)
        self.msa_transition = Transition(cfg.c_m, cfg.transition_n)
        self.outer_product_mean = OuterProductMean(cfg)
        self.tri_mul_out = TriangleMultiplication(cfg, outgoing=True)
        self.tri_mul_in = TriangleMultiplication(cfg, outgoing=False)
        self.tri_attn_start = TriangleAttention(cfg, starting=True)
        self.tri_attn_end = TriangleAttention(cfg, starting=False)
        self.pair_transition = Transition(cfg.c_z, cfg.transition_n)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = m + self.row_attn(m, z)
        m = m + self.col_attn(m)
        m = m + self.msa_transition(m)
        z = z + self.outer_product_mean(m)
        z = z + self.tri_mul_out(z)
        z = z + self.tri_mul_in(z)
        z = z + self.tri_attn_start(z)
        z = z + self.tri_attn_end(z)
        return m, z + self.pair_transition(z)


class Evoformer(nn.Module):
    """Input embedding, recycling and Evoformer blocks; forward returns the distogram loss."""

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tf_z_i = nn.Linear(cfg.target_dim, cfg.c_z)
        self.tf_z_j = nn.Linear(cfg.target_dim, cfg.c_z)
        self.tf_m = nn.Linear(cfg.target_dim, cfg.c_m)
        self.msa_m = nn.Linear(cfg.msa_dim, cfg.c_m)
        # A lookup of the clipped offset i - j: a Linear on its one-hot, without the bias.
        self.relpos = nn.Embedding(2 * cfg.max_relpos + 1, cfg.c_z)
        self.recycle_norm_m = nn.LayerNorm(cfg.c_m)
        self.recycle_norm_z = nn.LayerNorm(cfg.c_z)
        self.blocks = nn.ModuleList(EvoformerBlock(cfg) for _ in range(cfg.n_block))
        self.distogram = nn.Linear(cfg.c_z, cfg.n_bins)

    def iteration(
        self,
        target_feat: torch.Tensor,
        msa_feat: torch.Tensor,
        m_prev: torch.Tensor,
        z_prev: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass: embed the features, add the recycled ones, run the blocks."""
        R, k = target_feat.shape[1], self.cfg.max_relpos
        r = torch.arange(R, device=target_feat.device)
        offset = (r[:, None] - r[None, :]).clamp(-k, k) + k
        z = self.tf_z_i(target_feat)[:, :, None] + self.tf_z_j(target_feat)[:, None, :]
        z = z + self.relpos(offset) + self.recycle_norm_z(z_prev)
        m = self.msa_m(msa_feat) + self.tf_m(target_feat)[:, None]
        # Only the first MSA row (the target sequence itself) receives the recycled row.
        m = torch.cat((m[:, :1] + self.recycle_norm_m(m_prev)[:, None], m[:, 1:]), dim=1)
        for block in self.blocks:
            m, z = block(m, z)
        return m, z

    def forward(
        self, target_feat: torch.Tensor, msa_feat: torch.Tensor, distogram_bins: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.cfg
        B, R = target_feat.shape[0], target_feat.shape[1]
        m_prev = msa_feat.new_zeros((B, R, cfg.c_m))
        z_prev = msa_feat.new_zeros((B, R, R, cfg.c_z))
        # Recycling: earlier passes only provide inputs, so no gradient flows into them.
        # The detach is what keeps them out of backward (a traced graph keeps no grad
        # mode); no_grad just spares eager mode from storing their activations.
        with torch.no_grad():
            for _ in range(cfg.n_recycle):
                m, z = self.iteration(target_feat, msa_feat, m_prev, z_prev)
                m_prev, z_prev = m[:, 0].detach(), z.detach()
        _, z = self.iteration(target_feat, msa_feat, m_prev, z_prev)
        logits = self.distogram(z + z.transpose(1, 2))  # symmetric in i, j
        return F.cross_entropy(logits.reshape(-1, cfg.n_bins), distogram_bins.reshape(-1))


def evoformer(
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    **overrides: int,
) -> Workload:
    """Build a tiny Evoformer and random features with symmetric random distogram bins."""
    cfg = replace(EvoformerConfig(), **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Evoformer(cfg)
    B, S, R = batch_size or cfg.batch_size, cfg.n_seq, cfg.n_res
    g = torch.Generator().manual_seed(seed)
    aatype = torch.randint(0, N_AA, (B, R), generator=g)
    target_feat = F.one_hot(aatype, cfg.target_dim).float()
    msa = torch.randint(0, N_MSA, (B, S, R), generator=g)
    msa[:, 0] = aatype  # the first MSA row is the target sequence
    extra = torch.rand(B, S, R, cfg.msa_dim - N_MSA, generator=g)
    msa_feat = torch.cat((F.one_hot(msa, N_MSA).float(), extra), dim=-1)
    bins = torch.randint(0, cfg.n_bins, (B, R, R), generator=g)
    upper = torch.ones(R, R, dtype=torch.bool).triu()
    bins = torch.where(upper, bins, bins.transpose(1, 2))  # distances are symmetric
    batch = (target_feat, msa_feat, bins)
    return Workload(model=model, inputs=tuple(t.to(device) for t in batch), name="evoformer")
