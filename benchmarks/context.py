"""Context parallelism: activation memory per rank against the sequence length, the balance
of causal attention work over the ranks, and the step time.

    python benchmarks/context.py [--seq 512 1024 2048] [--cp 1 2 4] [--d-model 128]
                                 [--layers 2] [--only memory|balance|time|simulate]
                                 [--device cpu|cuda]

Memory: a GPT (and Llama, GQA) of ``--d-model`` with ``--layers`` layers, batch 2, one training
step with every rank a thread (``run_in_threads``, ``PeakMemory``): the measured peak of
what the step made on the fullest rank, beside the plan's estimate, and that peak times
cp over one device's (goal: <= 1.15, activations falling as 1 / cp). ``allgather`` holds
every layer's keys and values whole for its backward, which ``ulysses`` does not; ``ring``
holds what ``allgather`` does (its blocks land in the same tensors).

Balance: each rank's causal attention FLOPs (``cost.piece_flops``: a chunk late in the
sequence sees more keys), max over min, for the sequence cut in a zigzag (each rank
chunks i and 2 cp - 1 - i) and in plain runs (goal: zigzag <= 1.05).

Time: the median step of a Llama under cp over ``cp`` processes (gloo on CPU, NCCL with
``--device cuda``) against one process and against torch's ``context_parallel`` (ring
attention on DTensor, head-tail balanced, gradients all-reduced over the group) on the same
model and processes (goal: <= 1.0x), with each run's losses beside one process's. On CPU
torch's ring is routed to its CPU flash kernel (``_cpu_ring_attention``): its dispatcher
knows CUDA's fused ops only.

Simulate: the predicted step of each attention variant on H100s (``ct.simulate``) for a
Llama of d_model 1024, 16 heads over 4 key heads, 2 layers, 8,192 tokens in bf16, against
``allgather``: the ring's blocks land while attention computes, Ulysses moves heads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chronotope as ct  # noqa: E402
from chronotope.compile.simulate import simulate  # noqa: E402
from chronotope.cost.compute import piece_flops  # noqa: E402
from chronotope.cost.network import cluster_for  # noqa: E402
from chronotope.models import get_workload  # noqa: E402
from chronotope.policies import ParallelConfig, make, mesh  # noqa: E402
from chronotope.policies.context import VARIANTS  # noqa: E402
from chronotope.runtime.launch import free_port, launch  # noqa: E402
from chronotope.runtime.local import Optim, rank_specs, run_in_threads  # noqa: E402


def _workload(model: str, seq: int, d_model: int, layers: int = 2, **kw):
    length = {"gpt": "block_size"}.get(model, "seq_len")
    extra = {"n_kv_head": 2} if model == "llama" else {}
    return get_workload(model, d_model=d_model, n_head=8, n_layer=layers, vocab_size=512,
                        batch_size=2, **{length: seq}, **extra, **kw)


def _graph(w) -> ct.Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(w)


def memory_table(model: str, seqs: list[int], cps: list[int], d_model: int,
                 layers: int) -> Table:
    table = Table(title=f"{model} d_model={d_model}, 8 heads, {layers} layers, batch 2: what one "
                        "step makes on the fullest rank (MiB), and that x cp / one device's")
    for col in ("tokens", "cp", "attention", "estimate", "measured", "measured x cp / cp 1"):
        table.add_column(col, justify="right")
    for seq in seqs:
        w = _workload(model, seq, d_model, layers)
        graph = _graph(w)
        base = None
        for cp in cps:
            for variant in VARIANTS if cp > 1 else VARIANTS[:1]:
                plan = make(graph, ParallelConfig("cp", cp, cp_attention=variant))
                memory = plan.check().memory
                run = run_in_threads(ct.compile(plan), w, 1, Optim("sgd", 0.1),
                                     measure_memory=True)
                rank = max(range(cp), key=lambda r: run.peak_memory[r])
                measured = run.peak_memory[rank]
                base = base or measured
                estimate = memory[rank].activations + memory[rank].grads
                table.add_row(str(seq), str(cp), variant if cp > 1 else "-",
                              f"{estimate / 2**20:.1f}", f"{measured / 2**20:.1f}",
                              f"{measured * cp / base:.2f}")
    return table


def balance_table(seq: int, cps: list[int], d_model: int) -> Table:
    graph = _graph(_workload("gpt", seq, d_model))
    table = Table(title=f"GPT, {seq} tokens: causal attention FLOPs per rank, max / min")
    for col in ("cp", "zigzag", "plain runs"):
        table.add_column(col, justify="right")
    for cp in (c for c in cps if c > 1):
        spread = []
        for zigzag in (True, False):
            per = [0.0] * cp
            checked = mesh(graph, cp=cp, zigzag=zigzag).check()
            for rank, sequence in checked.sequences.items():
                per[rank] = sum(piece_flops(op) for op in sequence
                                if op.op.kind == "attention" and not op.is_backward)
            spread.append(max(per) / min(per))
        table.add_row(str(cp), f"{spread[0]:.3f}", f"{spread[1]:.2f}")
    return table


def _cpu_ring_attention() -> None:
    """Let torch's ring attention run on CPU: its dispatcher knows CUDA's fused attention ops
    only, and CPU's ``sdpa`` is ``_scaled_dot_product_flash_attention_for_cpu``. Both of its
    ops are routed to torch's own ``_templated_ring_attention`` (and backward), so the ring,
    its load balancing and its merge are torch's, each block run by the CPU flash kernel."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    aten = torch.ops.aten

    def local(args):
        mesh = next(a for a in args if isinstance(a, DTensor)).device_mesh
        return mesh, [a.to_local() if isinstance(a, DTensor) else a for a in args]

    def sharded(mesh, tensors):
        return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in tensors)

    def forward(op, args, kwargs):
        mesh, (q, k, v, *rest) = local(args)
        dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
        if kwargs.get("attn_mask") is not None:
            raise NotImplementedError("torch's ring attention takes no mask")
        return sharded(mesh, ring._templated_ring_attention(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
            is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale")))

    def backward(op, args, kwargs):
        mesh, (grad, q, k, v, out, lse, dropout_p, is_causal) = local(args)
        return sharded(mesh, ring._templated_ring_attention_backward(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad, grad_out_name="grad_out", query=q, key=k, value=v, out=out,
            logsumexp=lse, is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale")))

    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = forward
    ring.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = backward


def _torch_worker(rank: int, world: int, seq: int, d_model: int, steps: int, device: str,
                  port: int, out: str) -> None:
    """One rank of torch's context_parallel on the same Llama: the batch, labels and rotary
    tables sharded along the sequence (head-tail load balanced), SDPA swapped for ring
    attention, the gradients all-reduced over the group as one flat tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        _cpu_ring_attention()
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    w = _workload("llama", seq, d_model, device=device)
    model = w.model
    device_mesh = init_device_mesh(device, (world,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx, targets = (t.clone() for t in w.inputs)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, losses = [], []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with context_parallel(device_mesh, buffers=[idx, targets, model.cos, model.sin],
                              buffer_seq_dims=[1, 1, 0, 0]):
            loss = model(idx, targets)
            loss.backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in grads]).div_(world)
        dist.all_reduce(flat)
        for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(new)
        opt.step()
        sync()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach().clone())
    dist.all_reduce(mean := torch.stack(losses).div_(world))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:
        torch.save(([max(ts) for ts in zip(*gathered)], mean.tolist()), out)
    dist.destroy_process_group()


def torch_step(world: int, seq: int, d_model: int, steps: int, device: str
               ) -> tuple[float, list[float]]:
    """torch's median step and its losses, one process per rank."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "times.pt")
        mp.start_processes(_torch_worker,
                           args=(world, seq, d_model, steps, device, free_port(), out),
                           nprocs=world, join=True, start_method="spawn")
        times, losses = torch.load(out)
        return statistics.median(times[1:]), losses


def chronotope_step(w, cp: int, variant: str, steps: int) -> tuple[float, list[float]]:
    """chronotope's median step (slowest rank) and its losses."""
    graph = _graph(w)
    program = ct.compile(make(graph, ParallelConfig("cp", cp, cp_attention=variant)))
    results = launch(rank_specs(program, w), steps, Optim("sgd", 0.1), timeout=600)
    return statistics.median([max(ts) for ts in zip(*(r[2] for r in results))][1:]), \
        results[0][0]


def time_table(seq: int, cps: list[int], d_model: int, steps: int, device: str) -> Table:
    w = _workload("llama", seq, d_model, device=device)
    one, losses = chronotope_step(w, 1, "allgather", steps)
    table = Table(title=f"Llama d_model={d_model}, 8 heads over 2 key heads, 2 layers, batch "
                        f"2 x {seq} tokens, one process per rank on {device}: median step "
                        f"(ms) of {steps - 1}, slowest rank; losses' largest relative "
                        "difference from one process over the steps")
    for col in ("cp", "attention", "step ms", "/ one process", "loss diff",
                "torch context_parallel ms", "its loss diff", "chronotope / torch"):
        table.add_column(col, justify="right")

    def diff(got: list[float]) -> str:
        return f"{max(abs(a - b) / abs(b) for a, b in zip(got, losses)):.1e}"

    for cp in (c for c in cps if c > 1):
        theirs, their_losses = torch_step(cp, seq, d_model, steps, device)
        for variant in VARIANTS:
            ours, our_losses = chronotope_step(w, cp, variant, steps)
            table.add_row(str(cp), variant, f"{ours * 1e3:.1f}", f"{ours / one:.2f}",
                          diff(our_losses), f"{theirs * 1e3:.1f}", diff(their_losses),
                          f"{ours / theirs:.2f}")
    return table


def simulate_table(cps: list[int]) -> Table:
    w = get_workload("llama", d_model=1024, n_head=16, n_kv_head=4, n_layer=2,
                     vocab_size=1024, batch_size=1, seq_len=8192)
    graph = _graph(w)
    table = Table(title="Llama d_model=1024, 16 heads over 4 key heads, 2 layers, 8,192 "
                        "tokens, bf16 on H100 SXM: predicted step (ms)")
    for col in ("cp", "attention", "step ms", "/ allgather"):
        table.add_column(col, justify="right")
    for cp in (c for c in cps if c > 1):
        base = None
        for variant in VARIANTS:
            plan = mesh(graph, cp=cp, cp_attention=variant)
            plan.dtype = "bf16"
            step = simulate(ct.compile(plan), cluster_for(cp, "h100-sxm")).step_time
            base = base or step
            table.add_row(str(cp), variant, f"{step * 1e3:.3f}", f"{step / base:.2f}")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--only", choices=("memory", "balance", "time", "simulate"))
    args = p.parse_args()
    console = Console(width=130)
    if args.only in (None, "memory"):
        for model in ("gpt", "llama"):
            console.print(memory_table(model, args.seq, args.cp, args.d_model, args.layers))
    if args.only in (None, "balance"):
        console.print(balance_table(max(args.seq), [*args.cp, 8], args.d_model))
    if args.only in (None, "time"):
        console.print(time_table(min(args.seq), args.cp, args.d_model, args.steps,
                                 args.device))
    if args.only in (None, "simulate"):
        console.print(simulate_table([*args.cp, 8]))


if __name__ == "__main__":
    main()
