"""BERT encoder with a masked-LM head: bidirectional, post-LN, padding-masked attention."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from chronotope.workload import Workload

MASK_ID = 1  # the [MASK] token of the example batch; any id below vocab_size would do


@dataclass(frozen=True)
class BertConfig:
    """Model shape plus the size of the example batch the factory builds."""

    vocab_size: int = 512
    seq_len: int = 32
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    d_ffn: int = 256
    type_vocab_size: int = 2
    dropout: float = 0.0
    ln_eps: float = 1e-12
    batch_size: int = 4


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention with an additive padding mask."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.query = nn.Linear(cfg.d_model, cfg.d_model)
        self.key = nn.Linear(cfg.d_model, cfg.d_model)
        self.value = nn.Linear(cfg.d_model, cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class Layer(nn.Module):
    """Post-LN block: LayerNorm after each residual sum, as in the original BERT."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ffn)
        self.fc2 = nn.Linear(cfg.d_ffn, cfg.d_model)
        self.ffn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.drop(self.attn(x, mask)))
        return self.ffn_norm(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class Bert(nn.Module):
    """Encoder plus MLM head; forward returns cross-entropy over the masked positions."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position_embeddings = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        self.emb_norm = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.transform = nn.Linear(cfg.d_model, cfg.d_model)
        self.transform_norm = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.decoder.weight = self.word_embeddings.weight  # tied
        nn.init.normal_(self.word_embeddings.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos)
        x = self.emb_drop(self.emb_norm(x + self.token_type_embeddings(token_type_ids)))
        # attention_mask is 1 on real tokens, 0 on padding: padded keys get -inf-like scores.
        pad = attention_mask[:, None, None, :] == 0
        mask = torch.zeros_like(pad, dtype=x.dtype).masked_fill(pad, torch.finfo(x.dtype).min)
        for layer in self.layers:
            x = layer(x, mask)
        h = self.transform_norm(F.gelu(self.transform(x)))
        logits = self.decoder(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)


def bert(
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    **overrides: int | float,
) -> Workload:
    """Build a tiny BERT and a padded MLM batch with ~15% of the real tokens masked."""
    cfg = replace(BertConfig(), **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Bert(cfg)
    B, T = batch_size or cfg.batch_size, cfg.seq_len
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, cfg.vocab_size, (B, T), generator=g)
    lengths = torch.randint(T // 2, T + 1, (B, 1), generator=g)
    attention_mask = (torch.arange(T) < lengths).long()
    token_type_ids = (torch.arange(T) >= lengths // 2).long() * attention_mask
    masked = (torch.rand(B, T, generator=g) < 0.15) & attention_mask.bool()
    masked[:, 0] = True  # at least one target per row, so the loss is never empty
    labels = torch.where(masked, ids, -100)
    input_ids = torch.where(masked, MASK_ID, ids)
    batch = (input_ids, token_type_ids, attention_mask, labels)
    return Workload(model=model, inputs=tuple(t.to(device) for t in batch), name="bert")
