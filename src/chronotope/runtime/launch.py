"""Running a Program as real processes on torch.distributed (gloo on CPU, NCCL on GPU).

``run_processes`` spawns one worker per rank on this machine. The same worker
code serves ``torchrun``: ``worker_main`` reads rank and world size from the
environment torchrun sets. A worker that dies or stops answering makes the
others fail within the timeout with an error naming it, and every worker exits.
"""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chronotope.compile.program import Program
from chronotope.errors import ChronotopeError
from chronotope.models.workload import Workload
from chronotope.runtime.local import Optim, Rank, RankSpec, RunResult, gather_params, rank_specs
from chronotope.runtime.transport import DistTransport


class WorkerError(ChronotopeError):
    """A worker process failed; the message names its rank and what it raised."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_rank(spec: RankSpec, steps: int, optim: Optim, backend: str,
               timeout: float) -> tuple[list[float], dict]:
    """One rank's whole run inside an initialized process group."""
    device = torch.device(f"cuda:{spec.rank % torch.cuda.device_count()}") \
        if backend == "nccl" else torch.device("cpu")
    rank = Rank(spec, DistTransport(timeout), optim, device)
    losses = []
    for _ in range(steps):
        losses += rank.step()
    return losses, rank.regions()


def _worker(index: int, specs: list[RankSpec], steps: int, optim: Optim, backend: str,
            port: int, timeout: float, out_dir: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=index,
                            world_size=len(specs), timeout=timedelta(seconds=timeout))
    try:
        result = train_rank(specs[index], steps, optim, backend, timeout)
        torch.save(result, os.path.join(out_dir, f"rank{index}.pt"))
    except BaseException as e:
        with open(os.path.join(out_dir, f"rank{index}.error"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


def run_processes(program: Program, workload: Workload, steps: int, optim: Optim | None = None,
                  backend: str = "gloo", timeout: float = 60.0) -> RunResult:
    """One process per rank on this machine; returns rank 0's losses and the final weights."""
    results = launch(rank_specs(program, workload), steps, optim, backend, timeout)
    return RunResult(results[0][0], gather_params([r[1] for r in results], workload))


def launch(specs: list[RankSpec], steps: int, optim: Optim | None = None,
           backend: str = "gloo", timeout: float = 60.0) -> list[tuple[list[float], dict]]:
    """Spawn the ranks and wait for all of them; a failure names the rank that caused it."""
    with tempfile.TemporaryDirectory(prefix="chronotope-run-") as out_dir:
        try:
            mp.start_processes(_worker, args=(specs, steps, optim or Optim(), backend,
                                              free_port(), timeout, out_dir),
                               nprocs=len(specs), join=True, start_method="spawn")
        except mp.ProcessExitedException as e:
            raise WorkerError(f"worker rank {e.error_index} died (exit code {e.exit_code}); "
                              "the other workers were stopped") from None
        except mp.ProcessRaisedException as e:
            path = os.path.join(out_dir, f"rank{e.error_index}.error")
            first = open(path).read() if os.path.exists(path) else str(e).strip().splitlines()[-1]
            raise WorkerError(f"worker rank {e.error_index} failed: {first}") from None
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(len(specs))]


def worker_main(spec_path: str, steps: int, optim: Optim, timeout: float = 60.0) -> None:
    """Entry point under torchrun: rank and world size come from the environment."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    rank = dist.get_rank()
    specs: list[RankSpec] = torch.load(spec_path, weights_only=False)
    if len(specs) != dist.get_world_size():
        raise WorkerError(f"the program has {len(specs)} ranks but torchrun started "
                          f"{dist.get_world_size()}; use --nproc-per-node {len(specs)}")
    try:
        losses, _ = train_rank(specs[rank], steps, optim, backend, timeout)
        if rank == 0:
            for i, loss in enumerate(losses):
                print(f"step {i}: loss {loss:.6f}", flush=True)
    finally:
        dist.destroy_process_group()
