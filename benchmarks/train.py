"""Training step time on real data: chronotope vs DistributedDataParallel, same run.

    python benchmarks/train.py [--steps 60] [--devices 2] [--workers 2]

The char-level GPT of examples/shakespeare on its shuffled batches, AdamW with the
same groups, schedule and clipping, on gloo processes sharing this machine's cores.
Both read every batch on every rank (DDP keeps its rank's share of it), so the
step time covers reading data, forward, backward, gradient reduction and the
optimizer. The figure to watch is the ratio (goal <= 1.05x; with --workers N, the same
DataLoader with N worker processes on both sides: goal <= 1.10x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.runtime.data import Batches, BatchLayout
from chronotope.runtime.launch import spawn
from chronotope.runtime.train import mean_step_time

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "shakespeare"
DATA = f"{EXAMPLE / 'data.py'}:batches"
WORKERS = "CHRONOTOPE_BENCH_WORKERS"  # the loader's worker processes, for every rank


def loader() -> torch.utils.data.DataLoader:
    """The example's batches, read by $CHRONOTOPE_BENCH_WORKERS worker processes."""
    sys.path.insert(0, str(EXAMPLE))
    from data import BATCH, windows

    return torch.utils.data.DataLoader(windows(), batch_size=BATCH, shuffle=True,
                                       drop_last=True, num_workers=int(os.environ[WORKERS]))
OPTIM = ct.Optim("adamw", 1e-3, weight_decay=0.1, clip=1.0, schedule="cosine", warmup=10)


def workload() -> ct.Workload:
    sys.path.insert(0, str(EXAMPLE))
    from model import char_gpt
    return char_gpt()


def _ddp(rank: int, steps: int, layout: BatchLayout, data: str) -> tuple[list[float], float]:
    world = dist.get_world_size()
    w = workload()
    model = torch.nn.parallel.DistributedDataParallel(w.model)
    opt = OPTIM.build(model.parameters())
    rates = OPTIM.scheduler(opt, steps)
    batches = Batches(data, layout)
    times, loss = [], torch.zeros(())
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        idx, targets = (t.chunk(world)[rank] for t in next(batches).values())
        loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip)
        opt.step()
        rates.step()
        times.append(time.perf_counter() - start)
    dist.all_reduce(loss := loss.detach())  # the whole batch's loss: the mean of the halves
    return times, float(loss) / world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0,
                        help="DataLoader worker processes per rank (0: read in the rank)")
    args = parser.parse_args()
    global DATA
    if args.workers:
        os.environ[WORKERS] = str(args.workers)
        DATA = f"{Path(__file__).resolve()}:loader"
    w = workload()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    program = ct.compile(ct.policies.mesh(graph, dp=args.devices))
    ours = ct.train(program, w, DATA, args.steps, OPTIM)
    theirs, theirs_loss = spawn(_ddp, args.devices, (args.steps, BatchLayout.of(w, graph),
                                                     DATA))[0]
    tokens = w.inputs[0].numel()
    ours_s = mean_step_time(ours)
    theirs_s = statistics.mean(theirs[1:])
    table = Table(title=f"char-GPT ({graph.num_params:,} parameters) on Shakespeare, "
                        f"{args.devices} gloo processes, {args.steps} steps, AdamW, "
                        f"{args.workers} loader workers per rank")
    for col in ("", "ms / step", "tokens / s", "final loss"):
        table.add_column(col, justify="right" if col else "left")
    table.add_row("chronotope dp (ct.train)", f"{ours_s * 1e3:.1f}", f"{tokens / ours_s:,.0f}",
                  f"{ours.losses[-1]:.4f}")
    table.add_row("DistributedDataParallel", f"{theirs_s * 1e3:.1f}",
                  f"{tokens / theirs_s:,.0f}", f"{theirs_loss:.4f}")
    Console().print(table)
    Console().print(f"chronotope / DDP step time: {ours_s / theirs_s:.2f}x (mean after the "
                    "first step)")


if __name__ == "__main__":
    main()
