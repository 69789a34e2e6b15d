"""Capture time of large configurations on the meta device (no weights are allocated).

    python benchmarks/capture.py [--models gpt3-1.3b gpt3-13b gpt3-175b] [--frontend fx]

Goal: GPT-3 175B in under 30 s on a 2-core laptop-class machine.
"""

from __future__ import annotations

import argparse
import time
import warnings

from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.models import get_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt3-1.3b", "gpt3-13b", "gpt3-175b"])
    p.add_argument("--frontend", choices=("auto", "fx", "export"), default="auto")
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


if __name__ == "__main__":
    main()
