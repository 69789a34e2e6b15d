"""The plan's memory estimate against the measured peak of one training step, per plan.

    python benchmarks/memory.py [--model gpt|llama|bert] [--d-model 256] [--seq 256]
                                [--layers 2] [--batch 8] [--dtype fp32 bf16]

Every rank runs as a thread here (``run_in_threads``) and ``PeakMemory`` measures the
most bytes the step made alive at once (activations, what autograd saves, gradients,
gathered weights and messages); the estimate's part for the same is its activations
plus its gradients. Weights and optimizer state, made before the step, are counted
apart by both and not compared. Goal: within 10% for every plan (the search decides
"fits" by the estimate). Activation swap is left out: here its CPU copies count too;
``benchmarks/gpu.py`` measures it, and compares the whole estimate with
``torch.cuda.max_memory_allocated`` on a GPU.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package

import chronotope as ct
from chronotope.models import get_workload
from chronotope.runtime.local import run_in_threads
from chronotope.runtime.optim import Optim
from tests.plan.test_memory import PLANS  # noqa: E402  (the plans the test holds to 10%)


def rows(args: argparse.Namespace, dtype: str) -> list[tuple[str, int, int]]:
    seq = {"gpt": "block_size"}.get(args.model, "seq_len")
    w = get_workload(args.model, d_model=args.d_model, n_head=8, n_layer=args.layers,
                     vocab_size=args.vocab, batch_size=args.batch, **{seq: args.seq})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    out = []
    for name, make in PLANS.items():
        if args.only and name not in args.only:
            continue
        plan = make(graph)
        plan.dtype = dtype
        memory = plan.check().memory
        run = run_in_threads(ct.compile(plan), w, 1, Optim("sgd", 0.1), measure_memory=True)
        worst = max(range(len(memory)), key=lambda r: run.peak_memory[r])
        out.append((name, memory[worst].activations + memory[worst].grads,
                    run.peak_memory[worst]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt", "llama", "bert"), default="gpt")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dtype", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--only", nargs="+", choices=tuple(PLANS), metavar="PLAN")
    args = p.parse_args()
    table = Table(title=f"{args.model} d_model={args.d_model}, {args.layers} layers, batch "
                        f"{args.batch} x {args.seq} tokens, vocabulary {args.vocab}: what one "
                        "step makes, on the rank that makes most (MiB)")
    for col in ("plan", "dtype", "estimate", "measured", "estimate / measured"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for dtype in args.dtype:
        for name, estimate, measured in rows(args, dtype):
            table.add_row(name, dtype, f"{estimate / 2**20:.1f}", f"{measured / 2**20:.1f}",
                          f"{estimate / measured:.2f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
