"""Order search: each pipeline rank's order of steps by CP-SAT, against the families' own.

    python benchmarks/order.py [--only solve|gpt3|gloo] [--seconds 30] [--rounds 3]

solve: how long the solver takes, and what it finds, on the issue's goals: a 4-stage x
8-micro-batch pipeline with split backwards (zb1's shape) in under 10 s, and a 3F1B
order (the Evoformer's recycling passes) for 4 stages in under 60 s; steps in equal
units and as the plan's FLOPs price them.

gpt3: GPT-3 1.3B (2,048 tokens a sample, one sample a micro-batch) in 4 stages on A100s
(bf16 peak x the cluster's efficiency, 200 GB/s between stages), every step priced by
its FLOPs: the step and bubble of zb1, zbv and chimera in their own order and in the
order searched within the same activation bound, and 1F1B's beside them.

gloo: a small GPT whose output head (a large vocabulary) makes the last stage heavier,
on as many gloo processes as this machine has cores: each step's time measured here
(``measure_ops``), the order searched on those times, and the measured step of 1F1B,
zb1's own order and the searched one (median of ``--rounds`` alternated runs of
``--steps`` steps, the slowest rank), as ratios to 1F1B (goal: searched <= zb1 < 1).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import warnings

from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.cost.network import cluster_for
from chronotope.measure import measure_ops
from chronotope.models import get_workload
from chronotope.policies import ParallelConfig, timeline
from chronotope.policies.config import make
from chronotope.runtime.launch import launch
from chronotope.runtime.local import Optim, rank_specs
from chronotope.search.order import OrderResult, search_order


def _graph(name: str, **kw) -> tuple[ct.Workload, ct.Graph]:
    w = get_workload(name, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


def _equal(rank: int, step: str) -> float:
    """Every F, I and W step one unit, a whole backward two."""
    return 2.0 if re.fullmatch(r"\d+B\d+", step) else 1.0


def solve_table(seconds: float) -> Table:
    table = Table(title="solve time: the order search's goals (CP-SAT on this machine's "
                        f"{os.cpu_count()} cores)")
    for col in ("case", "steps priced", "own order", "searched", "lower bound", "status",
                "solve s", "goal s"):
        table.add_column(col, justify="left" if col in ("case", "steps priced") else "right")
    _, gpt = _graph("gpt", n_layer=8, batch_size=8)
    _, evoformer = _graph("evoformer", batch_size=8)
    cases = [("zb1: 4 stages x 8, split backwards", gpt, "zb1", 10, {"step_cost": _equal},
              "equal (units)"),
             ("zb1: 4 stages x 8, split backwards", gpt, "zb1", 10, {}, "FLOPs at 1 TFLOP/s (us)"),
             ("zbv: 4 ranks x 2 stages x 8", _graph("gpt", n_layer=16, batch_size=8)[1],
              "zbv", 10, {}, "FLOPs at 1 TFLOP/s (us)"),
             ("3f1b: Evoformer, 4 stages x 8", evoformer, "3f1b", 60, {}, "FLOPs")]
    for label, graph, family, goal, cost, priced in cases:  # (priced: what times the steps)
        found = search_order(graph, ParallelConfig(family, devices=4, micro=8),
                             seconds=min(seconds, goal), **cost)
        unit = 1.0 if cost else 1e6
        table.add_row(label, priced, *(f"{x * unit:.3f}" for x in (
            found.given_makespan, found.makespan, found.solved.bound)),
            found.solved.status, f"{found.solved.seconds:.1f}", f"< {goal}")
    return table


def gpt3_table(seconds: float, micro: int) -> Table:
    cluster = cluster_for(8, "dgx-a100")
    times = {"flops_per_s": cluster.peak("bf16") * cluster.efficiency, "bytes_per_s": 2e11}
    _, graph = _graph("gpt3-1.3b", device="meta", batch_size=micro)
    one_f_one_b = timeline(make(graph, ParallelConfig("1f1b", devices=4, micro=micro)),
                           **times)
    table = Table(title=f"GPT-3 1.3B, 4 stages x {micro} micro-batches of 2,048 tokens on "
                        "A100s, steps priced by their FLOPs (1F1B: "
                        f"{one_f_one_b.makespan * 1e3:.1f} ms, bubble "
                        f"{one_f_one_b.bubble_ratio:.1%})")
    for col in ("schedule", "own ms", "own bubble", "searched ms", "searched bubble",
                "lower bound ms", "status", "solve s", "kept per rank"):
        table.add_column(col, justify="right")
    for family in ("zb1", "zbv", "chimera"):
        found: OrderResult = search_order(
            graph, ParallelConfig(family, devices=4, micro=micro), seconds=seconds, **times)
        table.add_row(family, f"{found.given_makespan * 1e3:.1f}", f"{found.given_bubble:.1%}",
                      f"{found.makespan * 1e3:.1f}", f"{found.bubble:.1%}",
                      f"{found.solved.bound * 1e3:.1f}", found.solved.status,
                      f"{found.solved.seconds:.1f}",
                      " ".join(str(found.kept[r]) for r in sorted(found.kept)))
    return table


def gloo_table(steps: int, rounds: int, micro: int) -> Table:
    stages = max(2, min(4, os.cpu_count() or 1))
    shape = {"n_layer": 4, "d_model": 256, "block_size": 128, "vocab_size": 16384,
             "batch_size": 2 * micro}
    w, graph = _graph("gpt", **shape)
    measured = measure_ops(graph, w, processes=stages)
    config = ParallelConfig("zb1", devices=stages, micro=micro)
    found = search_order(graph, config, measured=measured, seconds=20)
    plans = {"1f1b": make(graph, ParallelConfig("1f1b", devices=stages, micro=micro)),
             "zb1, own order": make(graph, config), "zb1, searched order": found.plan}
    programs = {name: ct.compile(plan) for name, plan in plans.items()}
    runs: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(rounds):  # alternated: this machine's speed drifts
        for name, program in programs.items():
            results = launch(rank_specs(program, w), steps, Optim("sgd", 0.1), timeout=600)
            per_step = [max(ts) for ts in zip(*(r[2] for r in results))]
            runs[name].append(statistics.median(per_step[1:]))
    step = {name: statistics.median(ts) for name, ts in runs.items()}
    table = Table(title=f"GPT d_model 256, vocab 16,384 (a heavy head stage), "
                        f"{shape['batch_size']} x 128 tokens, {micro} micro-batches on "
                        f"{stages} gloo processes: steps timed here",
                  caption=f"the search: {found.solved.status} in {found.solved.seconds:.1f} s, "
                          f"no order under {found.solved.bound * 1e3:.1f} ms (simulated); "
                          + ("zb1's own order" if plans["zb1, own order"].steps ==
                             found.plan.steps else "an order of its own"))
    for col in ("schedule", "simulated ms", "measured ms", "measured / 1f1b"):
        table.add_column(col, justify="right")
    for name, plan in plans.items():
        simulated = timeline(plan, measured=measured).makespan
        table.add_row(name, f"{simulated * 1e3:.1f}", f"{step[name] * 1e3:.1f}",
                      f"{step[name] / step['1f1b']:.2f}")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("solve", "gpt3", "gloo"))
    p.add_argument("--seconds", type=float, default=30.0, help="the solver's limit per order")
    p.add_argument("--micro", type=int, default=16, help="GPT-3's micro-batches")
    p.add_argument("--gloo-micro", type=int, default=8, help="the gloo table's micro-batches")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    console = Console(width=140)
    if args.only in (None, "solve"):
        console.print(solve_table(args.seconds))
    if args.only in (None, "gpt3"):
        console.print(gpt3_table(args.seconds, args.micro))
    if args.only in (None, "gloo"):
        console.print(gloo_table(args.steps, args.rounds, args.gloo_micro))


if __name__ == "__main__":
    main()
