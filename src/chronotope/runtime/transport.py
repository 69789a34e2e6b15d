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


def _run_of(total: torch.Tensor, ranks: tuple[int, ...], rank: int, dim: int) -> torch.Tensor:
    """What a reduce-scatter hands ``rank``: its run of the sum along ``dim``."""
    return total.chunk(len(ranks), dim)[ranks.index(rank)].contiguous()


def _to_sorted(items: list, ranks: tuple[int, ...]) -> list:
    """Items in ``ranks`` order, put in global rank order (a process group's order)."""
    return [items[ranks.index(r)] for r in sorted(ranks)]


def _from_sorted(items: list, ranks: tuple[int, ...]) -> list:
    order = sorted(ranks)
    return [items[order.index(r)] for r in ranks]


class ThreadTransport:
    """Messages between ranks run as threads of one process (tests, debugging)."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        # FIFO per (src, dst, tag): a fast rank may send the next step's message early.
        self.box: dict[tuple[int, int, int], deque[torch.Tensor]] = defaultdict(deque)
        self.cond = threading.Condition()
        self.failed: dict[int, BaseException] = {}
        self.calls: dict[tuple, int] = defaultdict(int)  # collectives each rank entered
        self.pending: dict[tuple, dict[int, torch.Tensor]] = defaultdict(dict)
        self.taken: dict[tuple, int] = defaultdict(int)

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

    def _exchange(self, t, ranks: tuple[int, ...], rank: int, what: str) -> list:
        """Every member's contribution (a tensor or list of them), in ``ranks`` order,
        once all of them arrived."""
        with self.cond:
            seq = self.calls[(ranks, rank)]
            self.calls[(ranks, rank)] += 1
            key = (ranks, seq)
            self.pending[key][rank] = [x.detach().clone() for x in t] \
                if isinstance(t, list) else t.detach().clone()
            self.cond.notify_all()
            ok = self.cond.wait_for(
                lambda: len(self.pending[key]) == len(ranks)
                or any(r in self.failed for r in ranks), self.timeout)
            dead = [r for r in ranks if r in self.failed and r not in self.pending[key]]
            if dead or not ok:
                missing = dead or [r for r in ranks if r not in self.pending[key]]
                who = ", ".join(f"rank {r}" for r in missing)
                raise RankFailed(f"rank {rank} waited in an {what} over ranks {list(ranks)} "
                                 f"for {who}, which failed or is stuck")
            pieces = [self.pending[key][r] for r in ranks]
            self.taken[key] += 1
            if self.taken[key] == len(ranks):
                del self.pending[key], self.taken[key]
            return pieces

    def all_reduce(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int) -> torch.Tensor:
        """Sum over ``ranks`` in rank order, so every member gets the same bits."""
        return sum(self._exchange(t, ranks, rank, "all-reduce"))

    def all_gather(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int) -> torch.Tensor:
        """The members' tensors stacked along a new first dim, in ``ranks`` order."""
        return torch.stack(self._exchange(t, ranks, rank, "all-gather"))

    def reduce_scatter(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int,
                       dim: int) -> torch.Tensor:
        return _run_of(sum(self._exchange(t, ranks, rank, "reduce-scatter")), ranks, rank, dim)

    def all_to_all(self, blocks: list[torch.Tensor], ranks: tuple[int, ...],
                   rank: int) -> list[torch.Tensor]:
        """``blocks[i]`` goes to ``ranks[i]``; returns the block each member sent here."""
        sent = self._exchange(blocks, ranks, rank, "all-to-all")
        return [theirs[ranks.index(rank)] for theirs in sent]

    def broadcast(self, t: torch.Tensor, root: int, ranks: tuple[int, ...],
                  rank: int) -> torch.Tensor:
        return self._exchange(t, ranks, rank, "broadcast")[ranks.index(root)]

    def fail(self, rank: int, error: BaseException) -> None:
        with self.cond:
            self.failed[rank] = error
            self.cond.notify_all()

    def flush(self) -> None:
        pass


class DistTransport:
    """torch.distributed point-to-point (gloo on CPU, NCCL on GPU), with timeouts.

    A collective's members come in the order the caller gives (its chunks, its
    gathered pieces); torch.distributed orders a group by global rank, so blocks are
    put in that order before and back after."""

    def __init__(self, timeout: float = 60.0, groups: list[tuple[int, ...]] = ()) -> None:
        self.timeout = timedelta(seconds=timeout)
        self.pending: list[dist.Work] = []
        world = dist.get_world_size()
        # Every rank creates every group, in the same order, as torch.distributed requires.
        made: dict[tuple[int, ...], dist.ProcessGroup | None] = {tuple(range(world)): None}
        for g in groups:
            key = tuple(sorted(g))
            if key not in made:
                made[key] = dist.new_group(list(key))
        self.made = made  # by sorted members; the default group: gradient norms

    def _group(self, ranks: tuple[int, ...]):
        return self.made[tuple(sorted(ranks))]

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise RankFailed(f"{what} within {self.timeout.total_seconds():.0f} s: {e}") from e

    def all_reduce(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int) -> torch.Tensor:
        out = t.detach().clone()
        work = dist.all_reduce(out, group=self._group(ranks), async_op=True)
        self._wait(work, f"rank {rank} did not finish an all-reduce over ranks {list(ranks)}")
        return out

    def all_gather(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int) -> torch.Tensor:
        """The members' tensors stacked along a new first dim, in ``ranks`` order (one
        buffer, no copy, when ``ranks`` are in rank order)."""
        out = torch.empty((len(ranks), *t.shape), dtype=t.dtype, device=t.device)
        if t.numel() == 0:
            return out
        work = dist.all_gather_single(out.view(-1), t.contiguous().view(-1),
                                      group=self._group(ranks), async_op=True)
        self._wait(work, f"rank {rank} did not finish an all-gather over ranks {list(ranks)}")
        if list(ranks) == sorted(ranks):
            return out
        return torch.stack(_from_sorted(list(out.unbind(0)), ranks))

    def reduce_scatter(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int,
                       dim: int) -> torch.Tensor:
        what = f"rank {rank} did not finish a reduce-scatter over ranks {list(ranks)}"
        group = self._group(ranks)
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter
            return _run_of(self.all_reduce(t, ranks, rank), ranks, rank, dim)
        rows = torch.cat(_to_sorted(list(t.chunk(len(ranks), dim)), ranks), dim)
        rows = rows.movedim(dim, 0).contiguous()
        out = torch.empty((rows.shape[0] // len(ranks), *rows.shape[1:]), dtype=t.dtype,
                          device=t.device)
        self._wait(dist.reduce_scatter_tensor(out, rows, group=group, async_op=True), what)
        return out.movedim(0, dim).contiguous()

    def all_to_all(self, blocks: list[torch.Tensor], ranks: tuple[int, ...],
                   rank: int) -> list[torch.Tensor]:
        """``blocks[i]`` goes to ``ranks[i]``; returns the block each member sent here
        (every block of one call has the same shape)."""
        flat = torch.cat([b.reshape(-1) for b in _to_sorted(blocks, ranks)])
        out = torch.empty_like(flat)
        work = dist.all_to_all_single(out, flat, group=self._group(ranks), async_op=True)
        self._wait(work, f"rank {rank} did not finish an all-to-all over ranks {list(ranks)}")
        return _from_sorted([x.view_as(blocks[0]) for x in out.chunk(len(blocks))], ranks)

    def broadcast(self, t: torch.Tensor, root: int, ranks: tuple[int, ...],
                  rank: int) -> torch.Tensor:
        out = t.clone() if rank == root else t
        work = dist.broadcast(out, root, group=self._group(ranks), async_op=True)
        self._wait(work, f"rank {rank} did not finish a broadcast from rank {root} over ranks "
                         f"{list(ranks)}")
        return out

    def send(self, t: torch.Tensor, src: int, dst: int, tag: int) -> None:
        self.pending.append(dist.isend(t.detach().contiguous(), dst, tag=tag))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, dst: int,
             tag: int, device: torch.device) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        self._wait(dist.irecv(buf, src, tag=tag),
                   f"rank {dst} got no message {tag} from rank {src}")
        return buf

    def flush(self) -> None:
        """Wait until every message this rank sent was taken."""
        for work in self.pending:
            self._wait(work, "a message this rank sent was not taken")
        self.pending.clear()
