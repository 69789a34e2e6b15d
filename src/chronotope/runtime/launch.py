"""Running a Program as real processes on torch.distributed (gloo on CPU, NCCL on GPU).

``run_processes`` starts one worker per rank on this machine (``spawn``, which
``runtime.train`` uses too), forked from a server that imported torch once. A worker
that dies or stops answering makes the others fail within the timeout with an error
naming it, and every worker exits. A worker whose launcher is gone (killed, its
terminal closed) exits at once. Ctrl-C or SIGTERM to the launcher (a scheduler
preempting the job) is passed on to the workers, which a training run lets end their
step together and save (``Stop``); others are stopped; either way ``Interrupted`` says
so.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chronotope.compile.program import Program
from chronotope.errors import ChronotopeError
from chronotope.runtime.local import (
    Rank,
    RankSpec,
    RunResult,
    gather_params,
    model_buffers,
    rank_specs,
)
from chronotope.runtime.optim import Optim, Rates
from chronotope.runtime.precision import Precision, check_precision, plan_precision
from chronotope.runtime.targets import check_sendable
from chronotope.runtime.transport import DistTransport
from chronotope.workload import Workload


class WorkerError(ChronotopeError):
    """A worker process failed; the message names its rank and what it raised."""


class Interrupted(ChronotopeError):
    """A signal (``signum``: SIGINT from Ctrl-C, SIGTERM from a scheduler) stopped the run,
    and its workers with it."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


STOPS = (signal.SIGINT, signal.SIGTERM)
STOP_GRACE = 60.0  # seconds workers get, once told to stop, to end their step and save
ORPHAN_POLL = 0.5  # seconds between a worker's looks at whether its launcher is alive


@contextmanager
def _on_stop_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` takes SIGINT and SIGTERM while inside, the previous handlers after; in the
    main thread only, the one Python delivers signals to."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in STOPS}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


class Stop:
    """Whether to stop a training run after this step: a stop signal to any rank stops
    every rank after the same step (the ranks agree on it with one all-reduce per step),
    so a checkpoint saved then is whole. Inside, SIGINT and SIGTERM only set the flag."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.signum = device, 0
        self.stopped = 0  # the signal the ranks agreed to stop on (0: none yet)
        self.handling = _on_stop_signals(self._note)

    def __enter__(self) -> Stop:
        self.handling.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handling.__exit__(*exc)

    def _note(self, signum: int, frame: object) -> None:
        self.signum = signum

    def agreed(self, *bad: bool) -> tuple[int, ...]:
        """The signal any rank got (0: none), then for each of ``bad`` (a loss that is not
        finite, say) whether any rank found it: the same on every rank."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            self.stopped = self.signum
            return (self.signum, *map(int, bad))
        flags = torch.tensor([self.signum, *map(int, bad)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.stopped = int(flags[0])
        return tuple(int(f) for f in flags)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(backend: str, local_rank: int) -> torch.device:
    """Where a rank computes: its GPU under NCCL (made current, as NCCL's object
    collectives and checkpoints expect), else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    torch.cuda.set_device(device)
    return device


def group_device(backend: str, local_rank: int) -> torch.device | None:
    """The GPU a NCCL process group is bound to (its rank's, made current), so that NCCL
    neither guesses it from the global rank nor warns; None for gloo."""
    return rank_device(backend, local_rank) if backend == "nccl" else None


def train_rank(spec: RankSpec, steps: int, optim: Optim, backend: str, timeout: float,
               precision: Precision | None = None
               ) -> tuple[list[float], dict, list[float], dict]:
    """One rank's whole run inside an initialized process group: its losses, parameter
    regions, step times and buffers."""
    device = rank_device(backend, spec.rank)
    rank = Rank(spec, DistTransport(timeout, spec.groups), optim, device,
                precision=precision)
    rates = Rates(optim, steps)
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        rates.apply(rank.optimizer)
        losses += rank.step()
        rates.advance()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return losses, rank.regions(), times, {n: t.detach().cpu() for n, t in rank.state.items()}


def _worker(index: int, payload: str, world: int, backend: str, port: int, timeout: float,
            out_dir: str, launcher: Connection) -> None:
    threading.Thread(target=exit_with, args=(launcher,), daemon=True).start()
    # A worker's own processes (DataLoader workers) start as in a plain script on this
    # platform (fork on Linux), not as this worker started: spawn imports torch again in
    # each, seconds per loader.
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    try:
        # Loaded here, not by multiprocessing: what fails to load is reported like any error.
        fn, args, environ = torch.load(payload, weights_only=False)
        os.environ.clear()  # the launcher's, now: a forkserver's is the one it started with
        os.environ.update(environ)
        if backend == "gloo":  # workers share this machine's cores: no oversubscription
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=index,
                                world_size=world, timeout=timedelta(seconds=timeout),
                                device_id=group_device(backend, index))
        result = os.path.join(out_dir, f"rank{index}.pt")
        torch.save(fn(index, *args), result + ".partial")
        os.replace(result + ".partial", result)  # whole, or not there
        dist.barrier()  # every rank done communicating before any tears its group down
    except BaseException as e:
        with open(os.path.join(out_dir, f"rank{index}.error"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def die_with(launcher: int) -> None:
    """Exit once the launcher, this process's parent, is gone: no worker trains on,
    orphaned, after it."""
    while os.getppid() == launcher:
        time.sleep(ORPHAN_POLL)
    os._exit(1)


def exit_with(launcher: Connection) -> None:
    """Exit once the launcher is gone, which closes its end of the pipe: a worker forked
    by a server has the server, not the launcher, as its parent."""
    try:
        launcher.recv()
    except EOFError:
        pass
    os._exit(1)


# Workers fork from a server that imported torch and chronotope once, where the platform
# has one: a spawned worker imports them again, seconds per worker on a busy machine.
START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
if START == "forkserver":
    multiprocessing.get_context(START).set_forkserver_preload(["torch", "chronotope"])


def spawn(fn, world: int, args: tuple = (), backend: str = "gloo",
          timeout: float = 60.0, watch: Callable[[], None] | None = None) -> list:
    """``fn(rank, *args)`` in ``world`` processes of one process group on this machine;
    every rank's result. A failure names the rank that caused it; ``watch`` is called
    every fraction of a second while they run, and once after."""
    with tempfile.TemporaryDirectory(prefix="chronotope-run-") as out_dir:
        payload = os.path.join(out_dir, "args.pt")
        try:
            torch.save((fn, args, dict(os.environ)), payload)
        except Exception as e:
            raise WorkerError(f"cannot send {getattr(fn, '__qualname__', fn)} and its arguments "
                              f"to worker processes: {type(e).__name__}: {e}") from e
        # Open until the run ends or this process is gone: then the workers exit.
        alive, launcher = multiprocessing.Pipe(duplex=False)
        with launcher:
            ctx = mp.start_processes(_worker, args=(payload, world, backend, free_port(),
                                                    timeout, out_dir, alive),
                                     nprocs=world, join=False, start_method=START)
            alive.close()
            stopped: list[int] = []
            try:
                with _passed_on(ctx.processes, stopped):
                    codes = _wait(ctx.processes, watch, stopped)
            finally:  # on a failure, or an interrupt here: no worker outlives the run
                _stop(ctx.processes)
        if stopped:
            raise Interrupted(f"interrupted by {signal.Signals(stopped[0]).name}", stopped[0])
        if codes is not None and not _finished(world, out_dir):
            raise _blame(codes, out_dir)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


GRACE = 3.0  # seconds the other workers get, after a first failure, to report their own


def _finished(world: int, out_dir: str) -> bool:
    """Whether every rank wrote its whole result and none an error: then a worker that
    died after it (gloo or NCCL aborting while the group is torn down) lost nothing."""
    return all(os.path.exists(os.path.join(out_dir, f"rank{r}.pt")) and
               not os.path.exists(os.path.join(out_dir, f"rank{r}.error"))
               for r in range(world))


@contextmanager
def _passed_on(processes: list, stopped: list[int]) -> Iterator[None]:
    """While the workers run, a first SIGINT or SIGTERM is passed on to them (as SIGTERM)
    and noted in ``stopped``; a second one stops waiting for them."""
    def stop(signum: int, frame: object) -> None:
        if stopped:
            raise KeyboardInterrupt
        stopped.append(signum)
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    with _on_stop_signals(stop):
        yield


def _wait(processes: list, watch: Callable[[], None] | None, stopped: list[int]
          ) -> list[int | None] | None:
    """None once every worker has ended well; else every worker's exit code (None: still
    running) a moment after the first failure, so the workers that failed in turn (their
    peer gone) have written down why, and a root cause is told from its consequences.
    Once ``stopped``, the workers get ``STOP_GRACE`` seconds to end."""
    deadline = None
    while True:
        if stopped and deadline is None:
            deadline = time.monotonic() + STOP_GRACE
        if deadline is not None and time.monotonic() > deadline:
            return [p.exitcode for p in processes]
        codes = [p.exitcode for p in processes]
        if all(c == 0 for c in codes):
            if watch:
                watch()
            return None
        if any(c not in (None, 0) for c in codes):
            deadline = time.monotonic() + GRACE
            while time.monotonic() < deadline and any(p.exitcode is None for p in processes):
                wait([p.sentinel for p in processes if p.exitcode is None], timeout=0.05)
            return [p.exitcode for p in processes]
        wait([p.sentinel for p in processes if p.exitcode is None], timeout=0.2)
        if watch:
            watch()


def _stop(processes: list) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


# What a worker raises when another one is gone: a consequence, not the cause.
_CONSEQUENCES = ("RankFailed", "DistBackendError", "DistNetworkError", "Connection closed by peer",
                 "Connection reset by peer")


def _blame(codes: list[int | None], out_dir: str) -> WorkerError:
    """The failure that caused the others: an error a worker's own code raised, else a
    worker that died, else what the first waiting worker saw."""
    errors = {r: _error(r, out_dir) for r in range(len(codes))}
    written = sorted((os.path.getmtime(os.path.join(out_dir, f"rank{r}.error")), r)
                     for r, e in errors.items() if e is not None)
    causes = [r for _, r in written if not any(c in errors[r] for c in _CONSEQUENCES)]
    if causes:
        return WorkerError(f"worker rank {causes[0]} failed: {errors[causes[0]]}")
    died = [r for r, c in enumerate(codes) if c not in (None, 0) and errors[r] is None]
    if died:
        return _exited(died[0], codes[died[0]], out_dir)
    first = written[0][1] if written else next(r for r, c in enumerate(codes) if c)
    return _exited(first, codes[first] or 1, out_dir)


def _error(index: int, out_dir: str) -> str | None:
    """What a worker's own code raised, as it wrote it down."""
    path = os.path.join(out_dir, f"rank{index}.error")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def _exited(index: int, code: int, out_dir: str) -> WorkerError:
    error = _error(index, out_dir)
    if error is not None:
        return WorkerError(f"worker rank {index} failed: {error}")
    if code == 1:  # Python raised before the worker's own code ran
        return WorkerError(
            f"worker rank {index} failed before it started (its traceback is printed above): "
            "a worker imports the script that started it again, so a script must start "
            "workers under `if __name__ == '__main__':`")
    return WorkerError(f"worker rank {index} died (exit code {code}); "
                       "the other workers were stopped")


def _train(index: int, specs: list[RankSpec], steps: int, optim: Optim, backend: str,
           timeout: float, precision: Precision | None
           ) -> tuple[list[float], dict, list[float], dict]:
    return train_rank(specs[index], steps, optim, backend, timeout, precision)


def run_processes(program: Program, workload: Workload, steps: int, optim: Optim | None = None,
                  backend: str = "gloo", timeout: float = 60.0,
                  precision: Precision | None = None, compile: str | None = None) -> RunResult:
    """One process per rank on this machine; returns rank 0's losses and the final weights.
    ``precision``: mixed precision, refused first if an op cannot run in it; ``compile``: a
    ``torch.compile`` backend for the forward regions (see ``rank_specs``)."""
    precision = precision or plan_precision(program.plan)
    check_precision(program.plan.graph, precision, "cuda" if backend == "nccl" else "cpu")
    optim = optim or Optim()
    optim.check_plan(program)
    results = launch(rank_specs(program, workload, compile), steps, optim, backend, timeout,
                     precision)
    return RunResult(results[0][0], gather_params([r[1] for r in results], workload),
                     results[0][2], buffers=model_buffers(results[0][3], workload))


def launch(specs: list[RankSpec], steps: int, optim: Optim | None = None,
           backend: str = "gloo", timeout: float = 60.0, precision: Precision | None = None
           ) -> list[tuple[list[float], dict, list, dict]]:
    """Spawn the ranks and wait for all of them; a failure names the rank that caused it."""
    check_sendable(specs[0].targets if specs else {})
    return spawn(_train, len(specs),
                 (specs, steps, optim or Optim(), backend, timeout, precision), backend, timeout)
