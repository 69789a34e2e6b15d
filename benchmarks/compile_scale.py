"""Time to check and compile large plans on the meta device (no weights).

    python benchmarks/compile_scale.py [--models gpt3-1.3b,gpt3-175b]

The 1,024-device case is GPT-3 175B (96 layers) with tensor parallel 8 x
pipeline 16 stages as one scale unit of 128 devices, run data parallel x 8
(``plan.scale``): checking and compiling cost what the unit costs. Goal: < 30 s.
"""

from __future__ import annotations

import argparse
import time
import warnings

from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.models import get_workload

CASES = [  # model, tp, pp, data-parallel replicas of the unit
    ("gpt3-1.3b", 2, 1, 1),
    ("gpt3-1.3b", 8, 4, 2),
    ("gpt3-13b", 8, 8, 4),
    ("gpt3-175b", 8, 16, 8),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(dict.fromkeys(c[0] for c in CASES)))
    args = p.parse_args()
    wanted = args.models.split(",")
    table = Table(title="check + compile on the meta device")
    for col in ("model", "ops", "tp x pp x dp", "ranks", "plan s", "check s", "compile s",
                "total s"):
        table.add_column(col, justify="left" if col in ("model", "tp x pp x dp") else "right")
    graphs = {}
    for model, tp, pp, dp in CASES:
        if model not in wanted:
            continue
        if model not in graphs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graphs[model] = ct.capture(get_workload(model, device="meta"))
        graph = graphs[model]
        t0 = time.perf_counter()
        plan = ct.policies.mesh(graph, tp=tp, pp=pp).scale(dp)
        t1 = time.perf_counter()
        plan.check()
        t2 = time.perf_counter()
        program = ct.compile(plan)
        t3 = time.perf_counter()
        assert program.ndevices == tp * pp
        table.add_row(model, f"{len(graph.ops):,}", f"{tp} x {pp} x {dp}",
                      f"{plan.world_size:,}", f"{t1 - t0:.1f}", f"{t2 - t1:.1f}",
                      f"{t3 - t2:.1f}", f"{t3 - t0:.1f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
