"""Generated code: its size per rank, and what its per-piece calls cost on one process.

    python benchmarks/codegen.py [--large gpt3-175b] [--tp 8] [--pp 16] [--micro 32]
                                 [--d-models 64 1024] [--steps 10] [--rounds 3]

* lines per rank of the generated module: the built-in GPT under dp, tp, zero-3 and
  1F1B (16 micro-batches, cut and folded), and a large GPT-3 captured on the meta
  device under tp x pp with its micro-batches folded (goal for GPT-3 175B, tp 8 x
  pp 16, 32 micro-batches: a few hundred lines);
* one process, the built-in GPT at each ``--d-models``: a step of the generated
  program vs the model run eagerly (goals: <= 1.10x at d_model 64, where per-op
  overhead dominates, and <= 1.02x at 1024). The step times are
  ``benchmarks/runtime_overhead.py``'s, median of alternated runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

from rich.console import Console
from rich.table import Table
from runtime_overhead import baseline_step_time, chronotope_step_time

import chronotope as ct
from chronotope.models import get_workload
from chronotope.policies import ParallelConfig, make

SMALL = {  # the built-in GPT: (policy config, its label)
    "dp 2": ParallelConfig("dp", 2),
    "tp 2": ParallelConfig("tp", 2),
    "zero-3 2": ParallelConfig("zero-3", 2),
    "1f1b 2 x 16, cut": ParallelConfig("1f1b", 2, micro=16, fold=False),
    "1f1b 2 x 16, folded": ParallelConfig("1f1b", 2, micro=16),
}


def lines(graph: ct.Graph, config: ParallelConfig) -> tuple[int, int, float]:
    """(most lines of one rank, mean over ranks, compile seconds) of ``config``'s program."""
    start = time.perf_counter()
    program = ct.compile(make(graph, config))
    took = time.perf_counter() - start
    counts = [len(program.code(r).splitlines()) for r in range(program.ndevices)]
    return max(counts), round(statistics.mean(counts)), took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--large", default="gpt3-175b", help="a built-in GPT-3 (none: skip)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=16)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--d-models", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    out = Console(width=120)

    table = Table(title="lines of generated code per rank")
    for col in ("model", "plan", "ranks", "most lines", "mean lines", "compile s"):
        table.add_column(col, justify="left" if col in ("model", "plan") else "right")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = ct.capture(get_workload("gpt", batch_size=16))
        for label, config in SMALL.items():
            table.add_row("gpt", label, str(config.devices), *map(str, _shown(gpt, config)))
        if args.large != "none":
            large = ct.capture(get_workload(args.large, device="meta", batch_size=args.micro))
            config = ParallelConfig("dp-tp", args.tp * args.pp, tp=args.tp, pp=args.pp,
                                    micro=args.micro)
            table.add_row(args.large, f"tp {args.tp} x pp {args.pp}, {args.micro} "
                          "micro-batches folded", str(config.devices),
                          *map(str, _shown(large, config)))
    out.print(table)

    table = Table(title=f"one process: the generated step vs the model, eager (median of "
                        f"{args.rounds} alternated runs of {args.steps - 1} steps' median)")
    for col in ("d_model", "eager ms", "chronotope ms", "ratio", "goal"):
        table.add_column(col, justify="right")
    for d_model in args.d_models:
        overrides = {"d_model": d_model, "n_layer": 4, "block_size": 64, "batch_size": 8}
        pairs = [(baseline_step_time("eager", 1, args.steps, overrides),
                  chronotope_step_time("dp", 1, args.steps, overrides))
                 for _ in range(args.rounds)]
        base = statistics.median(b for b, _ in pairs)
        ours = statistics.median(o for _, o in pairs)
        table.add_row(str(d_model), f"{base * 1e3:.1f}", f"{ours * 1e3:.1f}",
                      f"{ours / base:.2f}x", "<= 1.10x" if d_model <= 64 else "<= 1.02x")
    out.print(table)


def _shown(graph: ct.Graph, config: ParallelConfig) -> tuple[int, int, str]:
    most, mean, took = lines(graph, config)
    return most, mean, f"{took:.1f}"


if __name__ == "__main__":
    main()
