"""A character-level GPT for Tiny Shakespeare: chronotope's built-in GPT, sized for a CPU.

``chronotope train examples/shakespeare/model.py:char_gpt`` calls ``char_gpt``; the
returned model's forward takes ``(idx, targets)`` and returns the mean next-character
cross-entropy, so a batch from data.py is its whole input.
"""

import torch
from torch.utils.data import default_collate

from chronotope import Workload
from chronotope.models.gpt import GPT, GPTConfig

# isort: split
# data.py, next to this file: chronotope puts a model file's folder on sys.path.
from data import BATCH, BLOCK, vocabulary, windows


def char_gpt(batch_size: int | None = None, seed: int = 0, device: str = "cpu") -> Workload:
    """4 layers of width 128 over the corpus's characters; the example batch (which fixes
    every batch's shape) is the corpus's first windows."""
    cfg = GPTConfig(vocab_size=len(vocabulary()), block_size=BLOCK, n_layer=4, n_head=4,
                    d_model=128, dropout=0.0, batch_size=batch_size or BATCH)
    torch.manual_seed(seed)  # the weights depend on the seed alone
    with torch.device(device):
        model = GPT(cfg)
    idx, targets = default_collate([windows()[i] for i in range(cfg.batch_size)])
    return Workload(model=model, inputs=(idx.to(device), targets.to(device)), name="char-gpt")
