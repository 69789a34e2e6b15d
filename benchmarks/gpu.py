"""The checks to run whenever a GPU is at hand, in one script (about 5 minutes on one H100).

    python benchmarks/gpu.py [--out DIR] [--layers 4] [--batch 8] [--steps 6] [--device cuda]

1. paths: the CLI's CUDA paths, one rank on the GPU under NCCL: ``run --check`` in fp32,
   bf16 and with activation swap (pinned CPU memory), ``train --save`` then ``--resume``
   (its final loss against an uninterrupted run's);
2. speed: one GPU, a GPT-3 1.3B-shaped model (its 24 layers cut to ``--layers``), AdamW:
   chronotope's generated step vs the model run eagerly, fp32 and bf16, and compiled
   (``rank_specs(..., "inductor")`` vs ``torch.compile(model)``); tokens/s and MFU
   (6 x parameters + attention FLOPs per token over the step time and the GPU's dense
   16-bit peak; goal: chronotope / eager <= 1.02x);
3. memory: the plan's estimate against ``torch.cuda.max_memory_allocated`` for one training
   step (weights, gradients, AdamW state and the step's peak), under each activation
   policy, dtype and accumulation.

Every section runs apart: one that fails is reported and the others go on. What it
measured goes to ``DIR/gpu.json`` (with the device's name) and to the tables printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.graph.autocast import DTYPES
from chronotope.graph.capture import model_loss
from chronotope.models import get_workload
from chronotope.runtime.local import Rank, rank_specs
from chronotope.runtime.optim import Optim
from chronotope.runtime.precision import Precision
from chronotope.runtime.transport import OrderedTransport

PEAK_16BIT = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense tensor-core FLOP/s
OPTIM = Optim("adamw", 1e-4)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_16BIT.items() if k in name), None)


def cli(*argv: str, timeout: float = 180) -> dict:
    """One chronotope command in a fresh process: exit code, seconds, its last lines."""
    start = time.perf_counter()
    print("$ chronotope", *argv, flush=True)
    try:
        p = subprocess.run([sys.executable, "-m", "chronotope.cli", *argv], timeout=timeout,
                           capture_output=True, text=True)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
    lines = [line for line in str(text).splitlines() if line.strip()]
    return {"command": " ".join(argv), "rc": rc, "seconds": round(time.perf_counter() - start, 1),
            "tail": lines[-6:]}


def final_loss(result: dict) -> float | None:
    for line in reversed(result["tail"]):
        if line.startswith("{") and "final_loss" in line:
            return json.loads(line)["final_loss"]
    return None


def paths(args: argparse.Namespace) -> list[dict]:
    one = ("--backend", "nccl", "--devices", "1")
    rows = [cli("run", "gpt", *one, "--steps", "3", "--check"),
            cli("run", "gpt", *one, "--steps", "3", "--check", "--dtype", "bf16"),
            cli("run", "gpt", *one, "--steps", "3", "--check", "--swap", "full")]
    with tempfile.TemporaryDirectory() as d:
        first = cli("train", "gpt", *one, "--steps", "4", "--save", f"{d}/a", "--json")
        resumed = cli("train", "gpt", *one, "--steps", "8", "--resume", f"{d}/a", "--json")
        straight = cli("train", "gpt", *one, "--steps", "8", "--json")
    resumed["final_loss"], straight["final_loss"] = final_loss(resumed), final_loss(straight)
    return rows + [first, resumed, straight]


def workload(args: argparse.Namespace):
    return get_workload("gpt3-1.3b", device="cpu", batch_size=args.batch, n_layer=args.layers,
                        d_model=args.d_model, block_size=args.seq)


def model_flops_per_token(w) -> float:
    """6 x parameters (forward and backward of every weight) + the attention's 6 x 2 x
    layers x sequence x width (QK^T and AV, causal counted whole as Megatron does)."""
    params = sum(p.numel() for p in w.model.parameters())
    layers, (seq, width) = len(w.model.h), (w.inputs[0].shape[1], w.model.wte.weight.shape[1])
    return 6 * params + 12 * layers * seq * width


def timed(step: Callable[[], object], steps: int, device: torch.device) -> float:
    """Median seconds of ``steps`` steps after two warm-up steps."""
    times = []
    for i in range(steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def eager_step(w, device: torch.device, dtype: str, compiled: bool) -> Callable[[], object]:
    model = w.model.to(device)
    run = torch.compile(model) if compiled else model
    inputs = [t.to(device) for t in w.inputs]
    opt = OPTIM.build(model.parameters())
    low = DTYPES[dtype] if dtype != "fp32" else None

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if low is None:
            model_loss(run(*inputs)).backward()
        else:
            with torch.autocast(device.type, low):
                loss = model_loss(run(*inputs))
            loss.backward()
        opt.step()
    return step


def chronotope_rank(w, plan: ct.Plan, device: torch.device, compile: str | None = None
                    ) -> Rank:
    spec = rank_specs(ct.compile(plan), w, compile)[0]
    return Rank(spec, OrderedTransport(300.0), OPTIM, device,
                precision=Precision(plan.dtype))


def speed(args: argparse.Namespace) -> list[dict]:
    device, rows = torch.device(args.device), []
    for dtype, compiled in (("fp32", False), ("bf16", False), ("bf16", True)):
        w = workload(args)
        tokens = w.inputs[0].numel()
        flops = model_flops_per_token(w) * tokens
        eager = timed(eager_step(w, device, dtype, compiled), args.steps, device)
        del w
        _free(device)
        w = workload(args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = ct.policies.mesh(ct.capture(w))
        plan.dtype = dtype
        rank = chronotope_rank(w, plan, device, "inductor" if compiled else None)
        ours = timed(rank.step, args.steps, device)
        del rank, w
        _free(device)
        peak = peak_flops(device)
        rows.append({"dtype": dtype, "compiled": compiled, "eager_s": eager,
                     "chronotope_s": ours, "ratio": ours / eager,
                     "tokens_per_s": tokens / ours,
                     "mfu": flops / ours / peak if peak else None,
                     "eager_mfu": flops / eager / peak if peak else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


MEMORY_CASES = {  # name: (mesh policy keywords, dtype)
    "fp32, keep all": ({}, "fp32"),
    "fp32, recompute selective": ({"recompute": "selective"}, "fp32"),
    "fp32, recompute full": ({"recompute": "full"}, "fp32"),
    "fp32, swap full": ({"swap": "full"}, "fp32"),
    "fp32, 4 micro-batches": ({"micro": 4}, "fp32"),
    "bf16, keep all": ({}, "bf16"),
    "bf16, recompute full": ({"recompute": "full"}, "bf16"),
    "bf16, 4 micro-batches": ({"micro": 4}, "bf16"),
}


def memory(args: argparse.Namespace) -> list[dict]:
    device, rows = torch.device(args.device), []
    if device.type != "cuda":
        raise RuntimeError("the memory check reads torch.cuda.max_memory_allocated: --device cuda")
    for name, (kw, dtype) in MEMORY_CASES.items():
        try:
            w = workload(args)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = ct.policies.mesh(ct.capture(w), **kw)
            plan.dtype = dtype
            estimate = plan.check().memory[0]
            rank = chronotope_rank(w, plan, device)
            del w
            rank.step()  # the optimizer's state exists from here on
            rank.zero_grad()
            _free(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            rank.forward_backward()
            rank.update()
            peak = torch.cuda.max_memory_allocated(device)
            rows.append({"case": name, "estimate": estimate.total, "measured": peak,
                         "ratio": estimate.total / peak,
                         "estimate_step": estimate.activations + estimate.grads,
                         "measured_step": peak - before,
                         "step_ratio": (estimate.activations + estimate.grads)
                         / max(1, peak - before),
                         "held_before": before})
            print(json.dumps(rows[-1]), flush=True)
            del rank
        except Exception as e:  # noqa: BLE001  (one case's failure is a row, not the end)
            rows.append({"case": name, "error": f"{type(e).__name__}: {e}"[:400]})
        _free(device)
    for dtype in ("fp32", "bf16"):  # the baseline: the model run eagerly, the same step
        step = eager_step(workload(args), device, dtype, compiled=False)
        step()
        _free(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        peak = torch.cuda.max_memory_allocated(device)
        rows.append({"case": f"eager, {dtype}", "measured": peak, "measured_step": peak - before,
                     "held_before": before})
        print(json.dumps(rows[-1]), flush=True)
        del step
        _free(device)
    return rows


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def show(results: dict, console: Console) -> None:
    console.print(f"[bold]{results['device']}[/], torch {results['torch']}")
    if isinstance(results.get("paths"), list):
        t = Table(title="1. CUDA paths (one rank under NCCL)")
        for col in ("command", "exit", "s", "last line"):
            t.add_column(col)
        for r in results["paths"]:
            t.add_row(r["command"], str(r["rc"]), f"{r['seconds']:.0f}",
                      (r["tail"] or [""])[-1][:90])
        console.print(t)
    if isinstance(results.get("speed"), list):
        t = Table(title=f"2. one GPU, {results['model']}: chronotope vs eager (AdamW)")
        for col in ("dtype", "compiled", "eager ms", "chronotope ms", "ratio (goal <= 1.02)",
                    "tokens/s", "MFU", "eager MFU"):
            t.add_column(col, justify="right")
        for r in results["speed"]:
            mfu = (f"{r['mfu']:.1%}", f"{r['eager_mfu']:.1%}") if r["mfu"] else ("-", "-")
            t.add_row(r["dtype"], str(r["compiled"]), f"{r['eager_s'] * 1e3:.1f}",
                      f"{r['chronotope_s'] * 1e3:.1f}", f"{r['ratio']:.3f}x",
                      f"{r['tokens_per_s']:,.0f}", *mfu)
        console.print(t)
    if isinstance(results.get("memory"), list):
        t = Table(title=f"3. memory of one step, {results['model']}: the plan's estimate vs "
                        "torch.cuda.max_memory_allocated (GiB)")
        for col in ("case", "estimate", "measured", "ratio", "step estimate", "step measured",
                    "step ratio"):
            t.add_column(col, justify="right")
        for r in results["memory"]:
            if "error" in r:
                t.add_row(r["case"], r["error"][:80])
                continue
            if "estimate" not in r:
                t.add_row(r["case"], "-", gib(r["measured"]), "-", "-", gib(r["measured_step"]))
                continue
            t.add_row(r["case"], gib(r["estimate"]), gib(r["measured"]), f"{r['ratio']:.2f}",
                      gib(r["estimate_step"]), gib(r["measured_step"]), f"{r['step_ratio']:.2f}")
        console.print(t)
    for key in ("paths", "speed", "memory"):
        if isinstance(results.get(key), str):
            console.print(f"[red]{key} failed[/]: {results[key]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="folder for gpu.json (default: here)")
    p.add_argument("--layers", type=int, default=4, help="of GPT-3 1.3B's 24 (default 4)")
    p.add_argument("--batch", type=int, default=8, help="sequences (default 8)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2,048)")
    p.add_argument("--d-model", type=int, default=2048, help="width (default 2,048)")
    p.add_argument("--steps", type=int, default=6, help="timed steps after 2 warm-up ones")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", nargs="+", choices=("paths", "speed", "memory"))
    args = p.parse_args()
    device = torch.device(args.device)
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                     else "cpu", "torch": torch.__version__,
                     "model": f"GPT-3 1.3B shape (d {args.d_model}), {args.layers} layers, "
                              f"batch {args.batch} x {args.seq}"}
    console = Console(width=160)
    for key, fn in (("paths", paths), ("speed", speed), ("memory", memory)):
        if args.only and key not in args.only:
            continue
        start = time.perf_counter()
        try:
            results[key] = fn(args)
        except Exception:  # noqa: BLE001  (a section's failure is reported, the rest runs)
            results[key] = traceback.format_exc()[-2000:]
        console.print(f"{key}: {time.perf_counter() - start:.0f} s")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu.json").write_text(json.dumps(results, indent=1, default=str))
    show(results, console)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
