"""Point-to-point messages between ranks: threads in one process, or torch.distributed.

Every wait has a timeout, so a rank that died shows up as an error naming it. A
receive or collective called with ``async_op=True`` is only started: it returns a
``Started`` whose ``wait()`` gives what the call would have returned.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from chronotope.errors import ChronotopeError


class RankFailed(ChronotopeError):
    """A rank stopped answering (crashed, killed, or stuck) while others waited on it."""


class OrderError(ChronotopeError):
    """Ranks disagree on the order of their messages or collectives: NCCL would hang, or
    hand one message's bytes to another's receive."""


class Started:
    """A receive or collective under way; ``wait()`` gives its result (once)."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish = finish

    def wait(self) -> Any:
        return self._finish()

    def then(self, after: Callable[[Any], Any]) -> Started:
        """The same call, its result passed through ``after`` when waited on."""
        return Started(lambda: after(self._finish()))

    def returned(self, async_op: bool) -> Any:
        """What a call made with ``async_op`` returns: this, or its result now."""
        return self if async_op else self.wait()


def _run_of(total: torch.Tensor, ranks: tuple[int, ...], rank: int, dim: int) -> torch.Tensor:
    """What a reduce-scatter hands ``rank``: its run of the sum along ``dim``."""
    return total.chunk(len(ranks), dim)[ranks.index(rank)].contiguous()


def _counted(rows: torch.Tensor, count: int | None) -> torch.Tensor:
    """Rows that came where ``count`` of them were awaited (None: any): a mismatch is a
    bug, named."""
    if count is not None and rows.shape[0] != count:
        raise ChronotopeError(f"an exchange of routed rows brought {rows.shape[0]} rows where "
                              f"its routing awaited {count}: this is a bug in chronotope")
    return rows


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
        self.kinds: dict[tuple, tuple[int, str]] = {}  # call -> (first member, its collective)

    def send(self, t: torch.Tensor, src: int, dst: int, tag: int) -> None:
        with self.cond:
            self.box[(src, dst, tag)].append(t.detach().clone())
            self.cond.notify_all()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, dst: int,
             tag: int, device: torch.device, async_op: bool = False) -> Any:
        return Started(lambda: self._take(src, dst, tag).to(device)).returned(async_op)

    def _take(self, src: int, dst: int, tag: int) -> torch.Tensor:
        box = self.box[(src, dst, tag)]
        with self.cond:
            self._await_message(src, dst, tag, lambda: bool(box))
            return box.popleft()

    def _await_message(self, src: int, dst: int, tag: int, arrived: Callable[[], bool]) -> None:
        """Wait (holding ``cond``) until message ``tag`` from ``src`` has ``arrived``; a
        sender that failed, or the timeout, is a ``RankFailed`` naming it."""
        ok = self.cond.wait_for(lambda: arrived() or src in self.failed, self.timeout)
        if src in self.failed:
            raise RankFailed(f"rank {dst} waited on rank {src}, which failed: "
                             f"{self.failed[src]!r}")
        if not ok:
            raise RankFailed(f"rank {dst} waited {self.timeout:.0f} s for message {tag} "
                             f"from rank {src}; rank {src} is dead or stuck")

    def _refuse(self, rank: int, error: OrderError) -> None:
        """Rank ``rank`` stops on ``error``; the ranks waiting on it are told."""
        self.fail(rank, error)
        raise error

    def _exchange(self, t, ranks: tuple[int, ...], rank: int, what: str) -> Started:
        """Every member's contribution (a tensor or list of them), in ``ranks`` order,
        once all of them arrived: this rank's is handed in now, the others' waited for.
        Calls match by their group, as process groups do: its members in any order."""
        with self.cond:
            group = tuple(sorted(ranks))
            seq = self.calls[(group, rank)]
            self.calls[(group, rank)] += 1
            key = (group, seq)
            first, kind = self.kinds.setdefault(key, (rank, what))
            if kind != what:  # a process group would hang, or mix up the two calls
                self._refuse(rank, OrderError(f"call {seq} over ranks {list(ranks)} is an "
                                              f"{what} on rank {rank} but an {kind} on rank "
                                              f"{first}"))
            self.pending[key][rank] = [x.detach().clone() for x in t] \
                if isinstance(t, list) else t.detach().clone()
            self.cond.notify_all()
        return Started(lambda: self._collect(key, ranks, rank, what))

    def _collect(self, key: tuple, ranks: tuple[int, ...], rank: int, what: str) -> list:
        with self.cond:
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
                del self.pending[key], self.taken[key], self.kinds[key]
            return pieces

    def all_reduce(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int,
                   async_op: bool = False, inplace: bool = False) -> Any:
        """Sum over ``ranks`` in rank order, so every member gets the same bits."""
        return self._exchange(t, ranks, rank, "all-reduce").then(sum).returned(async_op)

    def all_gather(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int,
                   async_op: bool = False) -> Any:
        """The members' tensors stacked along a new first dim, in ``ranks`` order."""
        started = self._exchange(t, ranks, rank, "all-gather")
        return started.then(torch.stack).returned(async_op)

    def reduce_scatter(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int,
                       dim: int, async_op: bool = False) -> Any:
        """Run ``i`` along ``dim`` of the members' sum goes to ``ranks[i]``: each member's
        runs travel in rank order, as a process group's, and are summed in it."""
        members = tuple(sorted(ranks))
        runs = torch.cat(_to_sorted(list(t.chunk(len(ranks), dim)), ranks), dim)
        started = self._exchange(runs, members, rank, "reduce-scatter")
        return started.then(lambda got: _run_of(sum(got), members, rank, dim)).returned(async_op)

    def all_to_all(self, blocks: list[torch.Tensor], ranks: tuple[int, ...],
                   rank: int, async_op: bool = False) -> Any:
        """``blocks[i]`` goes to ``ranks[i]``; returns the block each member sent here."""
        started = self._exchange(blocks, ranks, rank, "all-to-all")
        mine = ranks.index(rank)
        return started.then(lambda sent: [theirs[mine] for theirs in sent]).returned(async_op)

    def all_to_all_rows(self, blocks: list[torch.Tensor], ranks: tuple[int, ...],
                        rank: int, async_op: bool = False, counts: list[int] | None = None
                        ) -> Any:
        """``blocks[i]`` (rows of one width, as many as each needs) goes to ``ranks[i]``;
        returns the block each member sent here, a copy of its own (as a process receives
        it: what the sender made is its sender's until the sender drops it). ``counts``:
        the rows that come from each member, where this rank knows them."""
        started = self.all_to_all(blocks, ranks, rank, True)
        awaited: list[int | None] = list(counts) if counts is not None else [None] * len(ranks)
        return started.then(lambda got: [_counted(b.clone(), n) for b, n in zip(got, awaited)]
                            ).returned(async_op)

    def broadcast(self, t: torch.Tensor, root: int, ranks: tuple[int, ...],
                  rank: int, async_op: bool = False) -> Any:
        started = self._exchange(t, ranks, rank, "broadcast")
        return started.then(lambda got: got[ranks.index(root)]).returned(async_op)

    def fail(self, rank: int, error: BaseException) -> None:
        with self.cond:
            self.failed[rank] = error
            self.cond.notify_all()

    def flush(self) -> None:
        pass


class OrderedTransport(ThreadTransport):
    """Messages matched as NCCL matches them: by order per pair of ranks, not by tag.

    The n-th receive a rank posts from a peer gets the n-th message that peer sent it,
    and the two ranks must post their messages to each other in one order (a send on one
    side where the other posts its receive): NCCL runs a pair's sends and receives on one
    stream each side, so any other order can hang. A tag that does not match, or two
    orders that disagree, is an ``OrderError`` naming both ranks and messages.
    """

    def __init__(self, timeout: float = 60.0) -> None:
        super().__init__(timeout)
        # per (src, dst): every message sent, in order (taken ones dropped), and receives posted
        self.queue: dict[tuple[int, int], dict[int, tuple[int, torch.Tensor]]] = defaultdict(dict)
        self.count: dict[tuple[int, int], int] = defaultdict(int)
        self.posted: dict[tuple[int, int], int] = defaultdict(int)
        # per (rank, peer): what ``rank`` posted with ``peer`` that ``peer`` has not yet
        self.sides: dict[tuple[int, int], deque[tuple[str, int]]] = defaultdict(deque)

    def _order(self, rank: int, peer: int, what: str, tag: int) -> None:
        """Rank ``rank`` posts a message to or from ``peer``: it must be the one ``peer``
        posts at the same place in its own order with ``rank``."""
        other = self.sides[(peer, rank)]
        if not other:
            self.sides[(rank, peer)].append((what, tag))
            return
        theirs, their_tag = other.popleft()
        if (theirs, their_tag) != ({"send": "recv", "recv": "send"}[what], tag):
            self._refuse(rank, OrderError(
                f"rank {rank} posts a {what} of message {tag} with rank {peer} where rank "
                f"{peer} posted a {theirs} of message {their_tag}: the two ranks order their "
                f"messages differently"))

    def send(self, t: torch.Tensor, src: int, dst: int, tag: int) -> None:
        with self.cond:
            self._order(src, dst, "send", tag)
            n = self.count[(src, dst)]
            self.count[(src, dst)] += 1
            self.queue[(src, dst)][n] = (tag, t.detach().clone())
            self.cond.notify_all()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, dst: int,
             tag: int, device: torch.device, async_op: bool = False) -> Any:
        with self.cond:
            self._order(dst, src, "recv", tag)
            n = self.posted[(src, dst)]
            self.posted[(src, dst)] += 1
        return Started(lambda: self._in_order(src, dst, tag, n).to(device)).returned(async_op)

    def _in_order(self, src: int, dst: int, tag: int, n: int) -> torch.Tensor:
        """The ``n``-th message ``src`` sent ``dst``, which must be message ``tag``."""
        box = self.queue[(src, dst)]
        with self.cond:
            self._await_message(src, dst, tag, lambda: n in box)
            got, t = box.pop(n)
            if got != tag:
                self._refuse(dst, OrderError(f"rank {dst}'s receive of message {tag} from rank "
                                             f"{src} matches message {got}, which rank {src} "
                                             f"sent first"))
            return t


class Replica:
    """One replica of a scaled plan (``plan.scale``) on a transport of all its ranks.

    Every replica runs the code of replica 0, which names ranks as replica 0 sees them:
    here rank ``g`` is global rank ``(g + replica * unit) % world``. A unit's groups
    shift with it, and the group of a device's replicas ``(d, d + unit, ...)`` maps
    onto itself (all-reduces run over it in sorted order, the same on every member)."""

    def __init__(self, inner: Any, replica: int, unit: int, world: int) -> None:
        self.inner, self.offset, self.world = inner, replica * unit, world

    def _g(self, rank: int) -> int:
        return (rank + self.offset) % self.world

    def _ranks(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self._g(r) for r in ranks)

    def send(self, t: torch.Tensor, src: int, dst: int, tag: int) -> None:
        self.inner.send(t, self._g(src), self._g(dst), tag)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, dst: int, tag: int,
             device: torch.device, async_op: bool = False) -> Any:
        return self.inner.recv(shape, dtype, self._g(src), self._g(dst), tag, device, async_op)

    def all_reduce(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int,
                   async_op: bool = False, inplace: bool = False) -> Any:
        return self.inner.all_reduce(t, tuple(sorted(self._ranks(ranks))), self._g(rank),
                                     async_op, inplace)

    def all_gather(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int,
                   async_op: bool = False) -> Any:
        return self.inner.all_gather(t, self._ranks(ranks), self._g(rank), async_op)

    def reduce_scatter(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int, dim: int,
                       async_op: bool = False) -> Any:
        return self.inner.reduce_scatter(t, self._ranks(ranks), self._g(rank), dim, async_op)

    def all_to_all(self, blocks: list[torch.Tensor], ranks: tuple[int, ...], rank: int,
                   async_op: bool = False) -> Any:
        return self.inner.all_to_all(blocks, self._ranks(ranks), self._g(rank), async_op)

    def all_to_all_rows(self, blocks: list[torch.Tensor], ranks: tuple[int, ...], rank: int,
                        async_op: bool = False, counts: list[int] | None = None) -> Any:
        return self.inner.all_to_all_rows(blocks, self._ranks(ranks), self._g(rank), async_op,
                                          counts)

    def broadcast(self, t: torch.Tensor, root: int, ranks: tuple[int, ...], rank: int,
                  async_op: bool = False) -> Any:
        return self.inner.broadcast(t, self._g(root), self._ranks(ranks), self._g(rank),
                                    async_op)

    def flush(self) -> None:
        self.inner.flush()


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

    def _started(self, work: dist.Work | None, what: str, result: Callable[[], Any]) -> Started:
        def finish() -> Any:
            if work is not None:
                self._wait(work, what)
            return result()

        return Started(finish)

    def all_reduce(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int,
                   async_op: bool = False, inplace: bool = False) -> Any:
        """The sum over ``ranks``; ``inplace``: into ``t`` itself (a buffer the caller made
        for it), else into a copy."""
        out = t.detach() if inplace else t.detach().clone()
        work = dist.all_reduce(out, group=self._group(ranks), async_op=True)
        what = f"rank {rank} did not finish an all-reduce over ranks {list(ranks)}"
        return self._started(work, what, lambda: out).returned(async_op)

    def all_gather(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int,
                   async_op: bool = False) -> Any:
        """The members' tensors stacked along a new first dim, in ``ranks`` order (one
        buffer, no copy, when ``ranks`` are in rank order)."""
        out = torch.empty((len(ranks), *t.shape), dtype=t.dtype, device=t.device)
        work = None if t.numel() == 0 else dist.all_gather_single(
            out.view(-1), t.contiguous().view(-1), group=self._group(ranks), async_op=True)

        def result() -> torch.Tensor:
            if list(ranks) == sorted(ranks):
                return out
            return torch.stack(_from_sorted(list(out.unbind(0)), ranks))

        what = f"rank {rank} did not finish an all-gather over ranks {list(ranks)}"
        return self._started(work, what, result).returned(async_op)

    def reduce_scatter(self, t: torch.Tensor, ranks: tuple[int, ...], rank: int,
                       dim: int, async_op: bool = False) -> Any:
        group = self._group(ranks)
        rows = torch.cat(_to_sorted(list(t.chunk(len(ranks), dim)), ranks), dim)
        rows = rows.movedim(dim, 0).contiguous()
        out = torch.empty((rows.shape[0] // len(ranks), *rows.shape[1:]), dtype=t.dtype,
                          device=t.device)
        work = dist.reduce_scatter_single(out, rows, group=group, async_op=True)
        what = f"rank {rank} did not finish a reduce-scatter over ranks {list(ranks)}"
        started = self._started(work, what, lambda: out.movedim(0, dim).contiguous())
        return started.returned(async_op)

    def all_to_all(self, blocks: list[torch.Tensor], ranks: tuple[int, ...],
                   rank: int, async_op: bool = False) -> Any:
        """``blocks[i]`` goes to ``ranks[i]``; returns the block each member sent here
        (every block of one call has the same shape)."""
        flat = torch.cat([b.reshape(-1) for b in _to_sorted(blocks, ranks)])
        out = torch.empty_like(flat)
        work = dist.all_to_all_single(out, flat, group=self._group(ranks), async_op=True)
        what = f"rank {rank} did not finish an all-to-all over ranks {list(ranks)}"
        started = self._started(work, what, lambda: _from_sorted(
            [x.view_as(blocks[0]) for x in out.chunk(len(blocks))], ranks))
        return started.returned(async_op)

    def all_to_all_rows(self, blocks: list[torch.Tensor], ranks: tuple[int, ...],
                        rank: int, async_op: bool = False, counts: list[int] | None = None
                        ) -> Any:
        """``blocks[i]`` (rows of one width, as many as each needs) goes to ``ranks[i]``,
        in one ``all_to_all_single`` split by the row counts; ``counts``: the rows that
        come from each member, where this rank knows them (else they go first, in an
        all-to-all of their own)."""
        group = self._group(ranks)
        ordered = _to_sorted(blocks, ranks)
        sizes = [b.shape[0] for b in ordered]
        what = f"rank {rank} did not finish an all-to-all of routed rows over ranks {list(ranks)}"
        if counts is None:
            sent = torch.tensor(sizes, dtype=torch.int64, device=blocks[0].device)
            got = torch.empty_like(sent)
            self._wait(dist.all_to_all_single(got, sent, group=group, async_op=True), what)
            split = got.tolist()
        else:
            split = _to_sorted(counts, ranks)
        out = ordered[0].new_empty((sum(split), *ordered[0].shape[1:]))
        work = dist.all_to_all_single(out, torch.cat(ordered), split, sizes,
                                      group=group, async_op=True)
        return self._started(work, what, lambda: _from_sorted(list(out.split(split)), ranks)
                             ).returned(async_op)

    def broadcast(self, t: torch.Tensor, root: int, ranks: tuple[int, ...],
                  rank: int, async_op: bool = False) -> Any:
        out = t.clone() if rank == root else t
        work = dist.broadcast(out, root, group=self._group(ranks), async_op=True)
        what = f"rank {rank} did not finish a broadcast from rank {root} over ranks {list(ranks)}"
        return self._started(work, what, lambda: out).returned(async_op)

    def send(self, t: torch.Tensor, src: int, dst: int, tag: int) -> None:
        self.pending.append(dist.isend(t.detach().contiguous(), dst, tag=tag))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, dst: int,
             tag: int, device: torch.device, async_op: bool = False) -> Any:
        buf = torch.empty(shape, dtype=dtype, device=device)
        work = dist.irecv(buf, src, tag=tag)
        what = f"rank {dst} got no message {tag} from rank {src}"
        return self._started(work, what, lambda: buf).returned(async_op)

    def flush(self) -> None:
        """Wait until every message this rank sent was taken."""
        for work in self.pending:
            self._wait(work, "a message this rank sent was not taken")
        self.pending.clear()
