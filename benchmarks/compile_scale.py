"""Time to plan, check and compile large plans on the meta device (no weights).

    python benchmarks/compile_scale.py [--models gpt3-1.3b,gpt3-13b,gpt3-175b]

Each case is a mesh plan (tensor parallel x pipeline stages, 1F1B over its
micro-batches), folded (``fold=True``): micro-batch 0 is planned, checked and
compiled, and every micro-batch's blocks are run from it (``compile/fold.py``).
GPT-3 13B on tp 8 x pp 8 with 16 micro-batches compiles all 64 ranks (goal:
< 10 s; about 13 s here; cut into micro-batches instead, ``--cut``, about 110 s).
The 1,024-device case is GPT-3 175B (96 layers) on tp 8 x pp 16 with 32
micro-batches as one scale unit of 128 devices run data parallel x 8 with
``plan.scale``: the unit is compiled once, with its gradients and loss summed
over the replicas, and every replica runs its code under a rank permutation
(``plan/replicas.py``; goal: < 60 s; about 53 s here).
"""

from __future__ import annotations

import argparse
import time
import warnings

from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.models import get_workload

CASES = [  # model, tp, pp, micro-batches, data-parallel replicas of the unit, goal s
    ("gpt3-1.3b", 2, 1, 1, 1, None),
    ("gpt3-1.3b", 8, 4, 4, 2, None),
    ("gpt3-13b", 8, 8, 16, 1, 10.0),
    ("gpt3-175b", 8, 16, 32, 8, 60.0),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(dict.fromkeys(c[0] for c in CASES)))
    p.add_argument("--cut", action="store_true",
                   help="cut the batch into every micro-batch's pieces instead of folding")
    args = p.parse_args()
    wanted = args.models.split(",")
    table = Table(title="plan + check + compile on the meta device"
                  + (" (cut micro-batches)" if args.cut else " (folded micro-batches)"))
    for col in ("model", "ops", "tp x pp x dp", "micro", "ranks", "plan s", "check s",
                "compile s", "total s", "goal"):
        table.add_column(col, justify="left" if col in ("model", "tp x pp x dp") else "right")
    graphs = {}
    for model, tp, pp, micro, dp, goal in CASES:
        if model not in wanted:
            continue
        if (model, micro) not in graphs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graphs[(model, micro)] = ct.capture(
                    get_workload(model, device="meta", batch_size=micro if micro > 1 else None))
        graph = graphs[(model, micro)]
        t0 = time.perf_counter()
        plan = ct.policies.mesh(graph, tp=tp, pp=pp, micro=micro, schedule="1f1b",
                                fold=not args.cut).scale(dp)
        t1 = time.perf_counter()
        plan.check()
        t2 = time.perf_counter()
        program = ct.compile(plan)
        t3 = time.perf_counter()
        assert program.ndevices == tp * pp
        table.add_row(model, f"{len(graph.ops):,}", f"{tp} x {pp} x {dp}", str(micro),
                      f"{plan.world_size:,}", f"{t1 - t0:.1f}", f"{t2 - t1:.1f}",
                      f"{t3 - t2:.1f}", f"{t3 - t0:.1f}", f"< {goal:.0f}" if goal else "")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
