"""Capture time of large configurations on the meta device (no weights are allocated),
and what capture's self-check (the graph and the model run once each on the example
batch) adds to capturing the built-in models with real weights.

    python benchmarks/capture.py [--models gpt3-1.3b gpt3-13b gpt3-175b] [--frontend fx]
                                 [--checked gpt llama bert t5 swin evoformer] [--rounds 3]

Goals: GPT-3 175B in under 30 s on a 2-core laptop-class machine; the self-check at most
the time of the capture itself on the built-ins.
"""

from __future__ import annotations

import argparse
import time
import warnings

from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.graph.verify import CHECK_UP_TO
from chronotope.models import get_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt3-1.3b", "gpt3-13b", "gpt3-175b"])
    p.add_argument("--frontend", choices=("auto", "fx", "export"), default="auto")
    p.add_argument("--checked", nargs="+",
                   default=["gpt", "llama", "bert", "t5", "swin", "evoformer", "hf-gpt2",
                            "hf-llama"])
    p.add_argument("--rounds", type=int, default=3, help="best of this many captures each way")
    args = p.parse_args()
    ct.capture(get_workload("gpt"))  # warm up imports and kernels once, outside the timings

    table = Table(title=f"capture on the meta device ({args.frontend})")
    for col in ("model", "parameters", "ops", "build s", "capture s", "unannotated"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for name in args.models:
        start = time.perf_counter()
        workload = get_workload(name, device="meta")
        built = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = ct.capture(workload, frontend=args.frontend)
        done = time.perf_counter()
        table.add_row(name, f"{graph.num_params / 1e9:.1f}B", str(len(graph)),
                      f"{built - start:.1f}", f"{done - built:.1f}",
                      str(len(graph.unannotated_ops())))
    Console().print(table)
    Console().print(self_check(args.checked, args.frontend, args.rounds))


def self_check(names: list[str], frontend: str, rounds: int) -> Table:
    """Capture with and without the self-check, best of ``rounds`` each, alternated."""
    table = Table(title=f"capture's self-check on the built-ins ({frontend}, best of {rounds})")
    for col in ("model", "parameters", "capture s", "with check s", "check / capture"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for name in names:
        workload = get_workload(name)
        best = {0: float("inf"), 1: float("inf")}
        for _ in range(rounds):
            for checked in (0, 1):
                start = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    graph = ct.capture(workload, frontend=frontend,
                                       check_up_to=CHECK_UP_TO if checked else 0)
                best[checked] = min(best[checked], time.perf_counter() - start)
        table.add_row(name, f"{graph.num_params / 1e6:.2f}M", f"{best[0]:.3f}",
                      f"{best[1]:.3f}", f"{(best[1] - best[0]) / best[0]:.0%}")
    return table


if __name__ == "__main__":
    main()
