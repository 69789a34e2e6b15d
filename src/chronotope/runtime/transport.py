"""Point-to-point messages between ranks: threads in one process, or torch.distributed.

Every wait has a timeout, so a rank that died shows up as an error naming it.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from datetime import timedelta

import torch
import torch.distributed as dist

from chronotope.errors import ChronotopeError


class RankFailed(ChronotopeError):
    """A rank stopped answering (crashed, killed, or stuck) while others waited on it."""


class ThreadTransport:
    """Messages between ranks run as threads of one process (tests, debugging)."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        # FIFO per (src, dst, tag): a fast rank may send the next step's message early.
        self.box: dict[tuple[int, int, int], deque[torch.Tensor]] = defaultdict(deque)
        self.cond = threading.Condition()
        self.failed: dict[int, BaseException] = {}

    def send(self, t: torch.Tensor, src: int, dst: int, tag: int) -> None:
        with self.cond:
            self.box[(src, dst, tag)].append(t.detach().clone())
            self.cond.notify_all()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, dst: int,
             tag: int, device: torch.device) -> torch.Tensor:
        key = (src, dst, tag)
        with self.cond:
            ok = self.cond.wait_for(lambda: self.box[key] or src in self.failed, self.timeout)
            if src in self.failed:
                raise RankFailed(f"rank {dst} waited on rank {src}, which failed: "
                                 f"{self.failed[src]!r}")
            if not ok:
                raise RankFailed(f"rank {dst} waited {self.timeout:.0f} s for message {tag} "
                                 f"from rank {src}; rank {src} is dead or stuck")
            return self.box[key].popleft().to(device)

    def fail(self, rank: int, error: BaseException) -> None:
        with self.cond:
            self.failed[rank] = error
            self.cond.notify_all()

    def flush(self) -> None:
        pass


class DistTransport:
    """torch.distributed point-to-point (gloo on CPU, NCCL on GPU), with timeouts."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timedelta(seconds=timeout)
        self.pending: list[dist.Work] = []

    def send(self, t: torch.Tensor, src: int, dst: int, tag: int) -> None:
        self.pending.append(dist.isend(t.detach().contiguous(), dst, tag=tag))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, dst: int,
             tag: int, device: torch.device) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        work = dist.irecv(buf, src, tag=tag)
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise RankFailed(f"rank {dst} got no message {tag} from rank {src} within "
                             f"{self.timeout.total_seconds():.0f} s: {e}") from e
        return buf

    def flush(self) -> None:
        """Wait until every message this rank sent was taken."""
        for work in self.pending:
            work.wait(self.timeout)
        self.pending.clear()
