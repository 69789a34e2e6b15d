"""Pipeline step time: chronotope 1F1B vs torch.distributed.pipelining's Schedule1F1B;
peak memory: co-shard vs recompute.

    python benchmarks/pipeline.py [--stages 4] [--micro 8] [--steps 6] [--layers 8]
                                  [--rounds 3] [--only time|zero-bubble|memory]

Time: the same built-in GPT on ``--stages`` gloo processes (cores shared evenly),
SGD, ``--micro`` micro-batches. torch's stages hold equal runs of blocks (the
first also the embeddings, the last the final norm and an untied copy of the
output projection); chronotope cuts stages of equal FLOPs from the captured
graph and orders them with op_order. Prints the median step time of each and
the ratio (goal: <= 1.00), the same 1F1B folded (one micro-batch compiled, all
run from it), and chronotope's zero-bubble zb1 beside them.

Zero bubble: zb1 fills the time a rank waits with weight gradients, so it gains
only where ranks have idle time. With more processes than cores (the time table's
4 on a 2-core machine) a waiting rank's core runs another rank, and there is none.
This table runs as many stages as cores (``--zb-stages``), few micro-batches
(``--zb-micro``) and wider layers (``--zb-d-model``), so that compute dominates and
1F1B's bubble is idle time, and prints zb1's step time as a ratio to chronotope's
1F1B in the same run (goal: <= 1.00).

Memory: one device, a GPT with long sequences (``--mem-seq``), one training
step under each activation policy: the plan's estimate and the measured peak of
what the step made (``PeakMemory``), as a ratio to full recompute (goal: co-shard
lower).
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
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import chronotope as ct
from chronotope.models import get_workload
from chronotope.runtime.launch import free_port, launch
from chronotope.runtime.local import Optim, rank_specs, run_in_threads


class Stage(nn.Module):
    """Blocks ``lo:hi`` of the GPT, with the embeddings first and the head last."""

    def __init__(self, gpt: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.blocks = nn.ModuleList(gpt.h[lo:hi])
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        if last:
            self.ln_f = gpt.ln_f
            self.head = nn.Linear(gpt.wte.weight.shape[1], gpt.wte.weight.shape[0], bias=False)
            with torch.no_grad():
                self.head.weight.copy_(gpt.wte.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _torch_worker(rank: int, world: int, micro: int, overrides: dict, steps: int, port: int,
                  out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    w = get_workload("gpt", **overrides)
    layers = len(w.model.h)
    lo, hi = rank * layers // world, (rank + 1) * layers // world
    module = Stage(w.model, lo, hi, rank == 0, rank == world - 1)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, micro, loss_fn=_loss)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    idx, targets = w.inputs
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(idx)
        elif rank == world - 1:
            schedule.step(target=targets)
        else:
            schedule.step()
        opt.step()
        times.append(time.perf_counter() - start)
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:  # a step ends when its slowest stage does
        torch.save([max(ts) for ts in zip(*gathered)], out)
    dist.destroy_process_group()


def torch_step_time(world: int, micro: int, steps: int, overrides: dict) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "times.pt")
        mp.start_processes(_torch_worker, args=(world, micro, overrides, steps, free_port(), out),
                           nprocs=world, join=True, start_method="spawn")
        return statistics.median(torch.load(out)[1:])


def chronotope_step_time(world: int, micro: int, steps: int, overrides: dict,
                         schedule: str = "1f1b") -> float:
    """``schedule``, or ``"<schedule> fold"``: one micro-batch compiled, all run from it."""
    w = get_workload("gpt", **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    name, _, fold = schedule.partition(" ")
    program = ct.compile(ct.policies.pipeline(graph, world, micro, name, fold=bool(fold)))
    results = launch(rank_specs(program, w), steps, Optim("sgd", 0.1), timeout=300)
    per_step = [max(ts) for ts in zip(*(r[2] for r in results))]
    return statistics.median(per_step[1:])


MEMORY_PLANS = {
    "keep all": {},
    "recompute full": {"recompute": "full"},
    "recompute selective": {"recompute": "selective"},
    "co-shard 2": {"coshard": 2},
    "co-shard 4": {"coshard": 4},
    "co-shard 2 + recompute full": {"coshard": 2, "recompute": "full"},
}


def memory_table(seq: int, d_model: int) -> Table:
    w = get_workload("gpt", block_size=seq, d_model=d_model, n_head=8, n_layer=2, batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    rows = {}
    for name, kw in MEMORY_PLANS.items():
        plan = ct.policies.mesh(graph, **kw)
        run = run_in_threads(ct.compile(plan), w, 1, Optim("sgd", 0.1), measure_memory=True)
        rows[name] = (plan.check().memory[0].activations, run.peak_memory[0])
    base = rows["recompute full"]
    table = Table(title=f"GPT d_model={d_model}, 8 heads, 2 layers, batch 2 x {seq} tokens, "
                        "one device: peak memory of one training step")
    for col in ("activations", "estimated MiB", "measured MiB", "measured / recompute full"):
        table.add_column(col, justify="right" if col != "activations" else "left")
    for name, (estimated, measured) in rows.items():
        table.add_row(name, f"{estimated / 2**20:.1f}", f"{measured / 2**20:.1f}",
                      f"{measured / base[1]:.2f}")
    return table


def step_times(stages: int, micro: int, steps: int, overrides: dict, rounds: int,
               schedules: tuple[str, ...], torch_too: bool) -> tuple[float, dict[str, float]]:
    """Median step time of torch's Schedule1F1B (0.0 without ``torch_too``) and of each of
    chronotope's ``schedules``, over ``rounds`` alternated runs (the machine drifts)."""
    runs = [(torch_step_time(stages, micro, steps, overrides) if torch_too else 0.0,
             {s: chronotope_step_time(stages, micro, steps, overrides, s) for s in schedules})
            for _ in range(rounds)]
    return (statistics.median(b for b, _ in runs),
            {s: statistics.median(o[s] for _, o in runs) for s in schedules})


def _title(overrides: dict, micro: int, stages: int, rounds: int, steps: int) -> str:
    return (f"GPT d_model={overrides['d_model']}, {overrides['n_layer']} layers, batch "
            f"{overrides['batch_size']} x {overrides['block_size']} tokens, {micro} "
            f"micro-batches, on {stages} gloo processes (median of {rounds} alternated runs "
            f"of {steps - 1} steps' median, slowest rank)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--zb-stages", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--zb-micro", type=int, default=4)
    p.add_argument("--zb-d-model", type=int, default=256)
    p.add_argument("--mem-seq", type=int, default=1024)
    p.add_argument("--mem-d-model", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each, alternated (this machine's speed drifts)")
    p.add_argument("--only", choices=("time", "zero-bubble", "memory"))
    args = p.parse_args()
    console = Console(width=120)
    shape = {"d_model": args.d_model, "n_layer": args.layers, "block_size": args.seq,
             "batch_size": args.batch}
    if args.only in (None, "time"):
        schedules = ("1f1b", "1f1b fold", "zb1")
        base, ours = step_times(args.stages, args.micro, args.steps, shape, args.rounds,
                                schedules, torch_too=True)
        table = Table(title=_title(shape, args.micro, args.stages, args.rounds, args.steps))
        for col in ("chronotope schedule", "torch Schedule1F1B ms", "chronotope ms", "ratio"):
            table.add_column(col, justify="right" if col != "chronotope schedule" else "left")
        for name, t in ours.items():
            table.add_row(name, f"{base * 1e3:.1f}", f"{t * 1e3:.1f}", f"{t / base:.2f}")
        console.print(table)
    if args.only in (None, "zero-bubble"):
        wide = {**shape, "d_model": args.zb_d_model}
        _, ours = step_times(args.zb_stages, args.zb_micro, args.steps, wide, args.rounds,
                             ("1f1b", "zb1"), torch_too=False)
        table = Table(title="zero bubble where ranks have idle time: "
                      + _title(wide, args.zb_micro, args.zb_stages, args.rounds, args.steps))
        for col in ("chronotope 1f1b ms", "chronotope zb1 ms", "zb1 / 1f1b", "goal"):
            table.add_column(col, justify="right")
        table.add_row(f"{ours['1f1b'] * 1e3:.1f}", f"{ours['zb1'] * 1e3:.1f}",
                      f"{ours['zb1'] / ours['1f1b']:.2f}", "<= 1.00")
        console.print(table)
    if args.only in (None, "memory"):
        console.print(memory_table(args.mem_seq, args.mem_d_model))


if __name__ == "__main__":
    main()
