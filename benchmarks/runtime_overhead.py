"""Step time of chronotope data parallel vs DistributedDataParallel, same model, same run.

    python benchmarks/runtime_overhead.py [--model gpt] [--devices 4] [--steps 10]

Both train the same built-in model on the same batch with SGD on gloo processes
(one intra-op thread each). Goal: chronotope DP <= 1.03x DDP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.graph.capture import model_loss
from chronotope.models import get_workload
from chronotope.runtime.launch import free_port, launch
from chronotope.runtime.local import Optim, rank_specs


def _ddp_worker(rank: int, world: int, model_name: str, steps: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    w = get_workload(model_name)
    tensors = [t.chunk(world)[rank] for t in w.inputs]
    model = torch.nn.parallel.DistributedDataParallel(w.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model_loss(model(*tensors)).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        torch.save(times, out)
    dist.destroy_process_group()


def ddp_step_time(model: str, world: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "times.pt")
        mp.start_processes(_ddp_worker, args=(world, model, steps, free_port(), out),
                           nprocs=world, join=True, start_method="spawn")
        return statistics.median(torch.load(out)[1:])


def chronotope_step_time(model: str, world: int, steps: int) -> float:
    w = get_workload(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = ct.compile(ct.policies.data_parallel(ct.capture(w), world))
    results = launch(rank_specs(program, w), steps, Optim("sgd", 0.1), timeout=120)
    return statistics.median(results[0][2][1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ddp = ddp_step_time(args.model, args.devices, args.steps)
    ours = chronotope_step_time(args.model, args.devices, args.steps)
    table = Table(title=f"{args.model}, data parallel on {args.devices} gloo processes "
                        f"(median of {args.steps - 1} steps)")
    for col in ("runtime", "step ms", "ratio"):
        table.add_column(col, justify="right" if col != "runtime" else "left")
    table.add_row("DistributedDataParallel", f"{ddp * 1e3:.1f}", "1.00")
    table.add_row("chronotope dp", f"{ours * 1e3:.1f}", f"{ours / ddp:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
