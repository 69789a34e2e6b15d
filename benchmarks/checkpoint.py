"""Resuming a run from a checkpoint under the same plan and under others, against the run
that was never interrupted.

    python benchmarks/checkpoint.py [--steps 8]

The char-level GPT of examples/shakespeare on its batches, AdamW with warmup and cosine:
trained data parallel on 2 processes with a checkpoint half way, then continued from that
checkpoint under each plan. The same plan must continue bitwise (fp32 on CPU); another
plan or device count within float32 rounding (its sums run in another order).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.policies import mesh, pipeline, zero

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "shakespeare"
DATA = f"{EXAMPLE / 'data.py'}:batches"
OPTIM = ct.Optim("adamw", 1e-3, weight_decay=0.1, clip=1.0, schedule="cosine", warmup=2)


def largest(a: dict, b: dict) -> float:
    scale = max(float(t.abs().max()) for t in b.values())
    return max(float((a[n] - b[n]).abs().max()) for n in b) / scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, str(EXAMPLE))
    from model import char_gpt
    w = char_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    half = args.steps // 2
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        whole = ct.train(ct.compile(mesh(graph, dp=2)), w, DATA, args.steps, OPTIM,
                         save=folder, save_every=half)
        whole_s = time.perf_counter() - start
        size = sum(f.stat().st_size for f in (Path(folder) / f"step-{half:08d}").iterdir())
        table = Table(title=f"char-GPT ({graph.num_params:,} parameters): {args.steps} steps, "
                            f"the last {args.steps - half} resumed from a dp 2 checkpoint "
                            f"({size / 2**20:.1f} MiB) under each plan")
        for col in ("resumed as", "devices", "max loss diff", "max param diff", "bitwise",
                    "run s"):
            table.add_column(col, justify="left" if col == "resumed as" else "right")
        table.add_row("(uninterrupted dp)", "2", "-", "-", "-", f"{whole_s:.1f}")
        for name, plan, n in (("dp", mesh(graph, dp=2), 2), ("tp", mesh(graph, tp=4), 4),
                              ("1f1b", pipeline(graph, 2, 2, "1f1b"), 2),
                              ("zero-3", zero(graph, 2, 3), 2), ("dp-tp", mesh(graph, 2, 2), 4)):
            start = time.perf_counter()
            run = ct.train(ct.compile(plan), w, DATA, args.steps, OPTIM,
                           resume=f"{folder}/step-{half:08d}")
            seconds = time.perf_counter() - start
            losses = max(abs(a - b) / abs(b) for a, b in zip(run.losses, whole.losses[half:]))
            params = largest(run.params, whole.params)
            bitwise = run.losses == whole.losses[half:] and params == 0.0
            table.add_row(name, str(n), f"{losses:.1e}", f"{params:.1e}",
                          "yes" if bitwise else "no", f"{seconds:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
