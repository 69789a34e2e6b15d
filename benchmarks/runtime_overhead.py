"""Step time of chronotope vs PyTorch's own parallel training, same model, same run.

    python benchmarks/runtime_overhead.py [--devices 1 2 4] [--steps 10] [--d-model 128]
                                          [--rounds 3] [--only dp tp zero-2 zero-3]

On gloo processes (cores shared evenly), with SGD and the same built-in GPT:

* one device: chronotope's generated code vs the model run eagerly (goal <= 1.02x):
  what the runtime's own calls per piece (``rt.enter`` / ``rt.leave``, the autograd
  regions' ``rt.backward``) cost; and compiled, the generated code with ``--compile``
  (its forward regions through ``torch.compile``) vs ``torch.compile(model)``
  (goal <= 1.02x);
* data parallel: chronotope ``dp`` vs ``DistributedDataParallel`` (goal <= 1.03x);
* tensor parallel: chronotope ``tp`` vs ``parallelize_module`` with Colwise/Rowwise
  on each block's linears (goal <= 1.00x). The baseline's fused q/k/v weight is
  reordered so each rank's rows are whole heads (as Megatron lays it out); its
  tied lm_head stays replicated, while chronotope's tp also splits it by column;
* ZeRO-2: chronotope ``zero-2`` vs FSDP2 ``fully_shard`` on each block and the root
  with ``reshard_after_forward=False`` (parameters stay gathered for the backward)
  (goal <= 1.00x);
* ZeRO-3: chronotope ``zero-3`` vs FSDP2 with ``reshard_after_forward=True``
  (goal <= 1.00x).
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


def _head_aligned(attn: torch.nn.Module, world: int) -> None:
    """Reorder the fused q/k/v rows so rank r's contiguous shard is [q_r; k_r; v_r]."""
    rows = attn.c_attn.weight.shape[0] // 3
    runs = [torch.arange(rows).chunk(world)[r] + part * rows
            for r in range(world) for part in range(3)]
    order = torch.cat(runs)
    with torch.no_grad():
        attn.c_attn.weight.copy_(attn.c_attn.weight[order])
        attn.c_attn.bias.copy_(attn.c_attn.bias[order])


def _baseline_worker(rank: int, world: int, kind: str, overrides: dict, steps: int, port: int,
                     out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    w = get_workload("gpt", **overrides)
    if kind == "eager":
        model, tensors = w.model, list(w.inputs)
    elif kind == "compiled":
        model, tensors = torch.compile(w.model), list(w.inputs)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(w.model)
        tensors = [t.chunk(world)[rank] for t in w.inputs]
    elif kind.startswith("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        model, reshard = w.model, kind == "fsdp-3"
        for block in model.h:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        tensors = [t.chunk(world)[rank] for t in w.inputs]
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,))
        model = w.model
        for block in model.h:
            _head_aligned(block.attn, world)
            parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(),
                                             "attn.c_proj": RowwiseParallel(),
                                             "mlp.c_fc": ColwiseParallel(),
                                             "mlp.c_proj": RowwiseParallel()})
        tensors = list(w.inputs)
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
    # Free DDP's reducer while the group is registered and let every rank finish before
    # the group goes: freeing the group under gloo work still in flight can deadlock.
    del model, opt
    dist.barrier()
    dist.destroy_process_group()


def baseline_step_time(kind: str, world: int, steps: int, overrides: dict) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "times.pt")
        mp.start_processes(_baseline_worker,
                           args=(world, kind, overrides, steps, free_port(), out),
                           nprocs=world, join=True, start_method="spawn")
        return statistics.median(torch.load(out)[1:])


def chronotope_step_time(policy: str, world: int, steps: int, overrides: dict,
                         compile: str | None = None) -> float:
    w = get_workload("gpt", **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    plan = {"dp": ct.policies.data_parallel, "tp": ct.policies.tensor_parallel,
            "zero-2": lambda g, n: ct.policies.zero(g, n, 2),
            "zero-3": lambda g, n: ct.policies.zero(g, n, 3)}[policy]
    program = ct.compile(plan(graph, world))
    results = launch(rank_specs(program, w, compile), steps, Optim("sgd", 0.1), timeout=300)
    return statistics.median(results[0][2][1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each side, alternated (this machine's speed drifts)")
    p.add_argument("--only", nargs="+", metavar="POLICY",
                   help="only these chronotope policies' rows (dp, tp, zero-2, zero-3)")
    args = p.parse_args()
    overrides = {"d_model": args.d_model, "n_layer": args.layers, "block_size": args.seq,
                 "batch_size": args.batch}
    comparisons = (  # row, baseline kind, chronotope policy, baseline's name, goal ratio
        ("one device", "eager", "dp", "the model, eager", 1.02),
        ("one device, compiled", "compiled", "dp", "torch.compile(model)", 1.02),
        ("data parallel", "ddp", "dp", "DistributedDataParallel", 1.03),
        ("tensor parallel", "tp", "tp", "parallelize_module (DTensor)", 1.00),
        ("ZeRO-2", "fsdp-2", "zero-2", "FSDP2, no reshard after forward", 1.00),
        ("ZeRO-3", "fsdp-3", "zero-3", "FSDP2 fully_shard", 1.00))
    rows = []
    for world in args.devices:
        for name, kind, policy, baseline, goal in comparisons:
            if (world == 1) != (kind in ("eager", "compiled")) or (
                    args.only and policy not in args.only):
                continue
            pairs = [(baseline_step_time(kind, world, args.steps, overrides),
                      chronotope_step_time(policy, world, args.steps, overrides,
                                           "inductor" if kind == "compiled" else None))
                     for _ in range(args.rounds)]  # alternated: the machine drifts
            rows.append((name, world, baseline, statistics.median(b for b, _ in pairs),
                         statistics.median(o for _, o in pairs), goal))
    table = Table(title=f"GPT d_model={args.d_model}, {args.layers} layers, batch {args.batch} x "
                        f"{args.seq} tokens, on gloo processes (median of {args.rounds} "
                        f"alternated runs of {args.steps - 1} steps' median)")
    for col in ("parallelism", "processes", "baseline", "baseline ms", "chronotope ms", "ratio",
                "goal"):
        table.add_column(col, justify="right" if col.endswith(("ms", "ratio", "es", "goal"))
                         else "left")
    for name, world, baseline, base, ours, goal in rows:
        table.add_row(name, str(world), baseline, f"{base * 1e3:.1f}", f"{ours * 1e3:.1f}",
                      f"{ours / base:.2f}x", f"<= {goal:.2f}x")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
