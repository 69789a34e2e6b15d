"""Simulator error: predicted vs measured step time of built-in plans on gloo.

    python benchmarks/simulator.py [--devices 2] [--steps 16] [--rounds 3]
                                   [--config medium|builtin]

Profiles this machine's collectives on ``--devices`` gloo processes (as
``chronotope profile`` does), measures every op's forward and backward here with
the threads each worker gets and calibrates the runtime's own work on as many
processes (``measure.calibrate``), then for each plan predicts one step
(``compile.simulate``) and trains it on gloo processes (median step time of the
steps after the first, slowest rank). Prints both and the error (goal: within
15%). This machine's speed drifts by 10% or more from minute to minute, so each
round profiles, calibrates and runs anew, and the error is the median of the
rounds' errors.

``--config medium`` (the default) is the built-in GPT made large enough that
compute and communication, not Python, take most of a step, as in real
training: d_model 256, 8 heads, 4 layers, 128 tokens, batch 8. ``builtin`` is
the tiny test model as it is, whose steps are mostly the runtime's own work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.compile import compile
from chronotope.compile.simulate import simulate
from chronotope.measure import calibrate, measure_ops
from chronotope.measure.profile import profile
from chronotope.models import get_workload
from chronotope.policies import mesh, pipeline, zero
from chronotope.runtime.launch import launch
from chronotope.runtime.local import Optim, rank_specs


def plans(graph, n: int) -> dict:
    return {
        f"dp {n}": lambda: mesh(graph, dp=n),
        f"tp {n}": lambda: mesh(graph, tp=n),
        f"zero-3 {n}": lambda: zero(graph, n, 3),
        f"gpipe {n} x 4 micro": lambda: pipeline(graph, n, 4, "gpipe"),
        f"1f1b {n} x 4 micro": lambda: pipeline(graph, n, 4, "1f1b"),
    }


CONFIGS = {
    "medium": {"d_model": 256, "n_head": 8, "n_layer": 4, "block_size": 128, "batch_size": 8},
    "builtin": {},
}


def one_round(args: argparse.Namespace, w, graph) -> dict[str, tuple[float, float]]:
    """Profile, measure and calibrate this machine, then predict and run every plan:
    (predicted, measured) seconds per plan."""
    cluster = profile(args.devices, repeats=100)
    measured = measure_ops(graph, w, repeats=7, processes=args.devices)
    calibration = calibrate(graph, w, measured, steps=9, processes=args.devices)
    out = {}
    for name, make in plans(graph, args.devices).items():
        program = compile(make(), cluster=cluster)
        predicted = simulate(program, cluster, measured, calibration=calibration).step_time
        results = launch(rank_specs(program, w), args.steps, Optim("sgd", 0.1))
        slowest = [max(r[2][i] for r in results) for i in range(1, args.steps)]
        out[name] = (predicted, statistics.median(slowest))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="gpt")
    p.add_argument("--config", choices=CONFIGS, default="medium")
    args = p.parse_args()
    out = Console()
    w = get_workload(args.model, **CONFIGS[args.config])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    rounds = []
    for k in range(args.rounds):
        with out.status(f"round {k + 1} of {args.rounds}: profile, calibrate, run the plans"):
            rounds.append(one_round(args, w, graph))
    table = Table(title=f"{args.model} ({args.config}) on {args.devices} gloo processes "
                        f"({os.cpu_count()} cores): predicted vs measured step time, "
                        f"{args.rounds} rounds")
    for col in ("plan", "predicted ms", "measured ms", "error per round", "median error"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    errors = []
    for name in rounds[0]:
        pairs = [r[name] for r in rounds]
        each = [(pred - real) / real for pred, real in pairs]
        error = statistics.median(each)
        errors.append(abs(error))
        table.add_row(name, f"{statistics.median(p for p, _ in pairs) * 1e3:.1f}",
                      f"{statistics.median(m for _, m in pairs) * 1e3:.1f}",
                      " ".join(f"{e:+.0%}" for e in each), f"{error:+.0%}")
    out.print(table)
    out.print(f"mean absolute error {statistics.mean(errors):.0%}, worst {max(errors):.0%} "
              "(median over rounds; goal: within 15%)")


if __name__ == "__main__":
    main()
