"""Tiny Shakespeare as next-character batches: fixed windows of the encoded text, shuffled.

The corpus, its vocabulary and the windows live here and model.py imports them, so
the model's vocabulary and example batch are the data's by construction.
"""

from functools import cache
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

CORPUS = Path(__file__).with_name("input.txt")  # the first ~250 KB of Tiny Shakespeare
BLOCK = 64  # characters a sample sees
BATCH = 16  # samples a step reads (dp splits them among the ranks)
HELD_OUT = 0.1  # the corpus's last tenth: validation text, never trained on


@cache
def text() -> str:
    return CORPUS.read_text(encoding="utf-8")


@cache
def vocabulary() -> str:
    """Every character of the corpus, sorted: a character's id is its place here."""
    return "".join(sorted(set(text())))


def encode(s: str) -> torch.Tensor:
    ids = {c: i for i, c in enumerate(vocabulary())}
    return torch.tensor([ids[c] for c in s], dtype=torch.int64)


def decode(ids: torch.Tensor) -> str:
    chars = vocabulary()
    return "".join(chars[i] for i in ids.tolist())


class Windows(Dataset):
    """Non-overlapping windows of ``block + 1`` characters: a sample's input is the first
    ``block`` of them, its targets the same shifted by one."""

    def __init__(self, ids: torch.Tensor, block: int = BLOCK) -> None:
        self.ids, self.block = ids, block

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[i * self.block:(i + 1) * self.block + 1]
        return window[:-1], window[1:]


@cache
def windows(split: str = "train") -> Windows:
    """The training text's windows, or (``"validation"``) the held-out tenth's."""
    ids = encode(text())
    cut = int(len(ids) * (1 - HELD_OUT))
    return Windows(ids[:cut] if split == "train" else ids[cut:])


def batches() -> DataLoader:
    """One pass over the training text in random order. Every rank calls this itself:
    the shuffle draws from torch's generator, which chronotope seeds alike on every rank,
    and ``drop_last`` keeps every batch the example batch's shape."""
    return DataLoader(windows(), batch_size=BATCH, shuffle=True, drop_last=True)


def validation() -> DataLoader:
    """The held-out text in order (``--eval-data``): its loss is the validation loss."""
    return DataLoader(windows("validation"), batch_size=BATCH, drop_last=True)
