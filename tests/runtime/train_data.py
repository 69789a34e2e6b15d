"""Data sources for the training tests; workers load them by path, as a user's file."""

import os
import signal
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

VOCAB, BLOCK, BATCH = 64, 32, 4  # the built-in GPT's


def _sequences(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (n, BLOCK + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def tokens() -> DataLoader:
    """Shuffled next-token batches: the order comes from torch's generator."""
    return DataLoader(_sequences(), batch_size=BATCH, shuffle=True, drop_last=True)


def ragged() -> DataLoader:
    """The last batch is short: 62 sequences in batches of 4."""
    return DataLoader(_sequences(62), batch_size=BATCH, drop_last=False)


def per_rank() -> list:
    """Rank 1 reads other batches than rank 0: each rank must read the same."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    x, y = _sequences()[rank * BATCH:(rank + 1) * BATCH]
    return [(x, y)]


def killing() -> object:
    """``tokens()``, but rank 1 dies at its 5th batch while the file $KILL_AT names exists."""
    marker = os.environ.get("KILL_AT", "")
    for i, batch in enumerate(tokens()):
        if i == 4 and dist.get_rank() == 1 and os.path.exists(marker):
            os.remove(marker)
            os.kill(os.getpid(), signal.SIGKILL)
        yield batch


def paced() -> object:
    """``tokens()``, a quarter of a second per batch: a run slow enough to stop midway."""
    for batch in tokens():
        time.sleep(0.25)
        yield batch


def with_workers() -> DataLoader:
    """``tokens()`` read by two worker processes; the start method they get is written to
    the file $START_METHOD_AT names."""
    import multiprocessing

    with open(os.environ["START_METHOD_AT"], "w") as f:
        f.write(multiprocessing.get_start_method())
    return DataLoader(_sequences(), batch_size=BATCH, shuffle=True, drop_last=True,
                      num_workers=2)
