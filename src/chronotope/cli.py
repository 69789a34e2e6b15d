"""The ``chronotope`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from chronotope.errors import ChronotopeError
from chronotope.graph import Graph, capture
from chronotope.models import default_device, load_workload

EXIT_USAGE = 2


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a built-in name (e.g. gpt, llama, gpt3-175b) or "
                   "path/to/file.py:factory")
    p.add_argument("--device", default=None,
                   help="where to build the model: cpu, or meta to capture without allocating "
                   "weights (default: meta for the large presets, cpu otherwise)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def cmd_capture(args: argparse.Namespace, out: Console) -> int:
    start = time.perf_counter()
    device = args.device or default_device(args.model)
    workload = load_workload(args.model, device=device, batch_size=args.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unannotated ops are listed below instead
        graph = capture(workload, frontend=args.frontend)
    seconds = time.perf_counter() - start
    unannotated = [
        {"op": op.name, "kind": op.kind, "source": str(op.source) if op.source else None}
        for op in graph.unannotated_ops()
    ]
    if args.json:
        print(json.dumps({
            "model": args.model, "num_ops": len(graph), "num_params": graph.num_params,
            "unannotated_ops": unannotated, "frontend": graph.frontend,
            "capture_s": round(seconds, 3),
        }))
        return 0
    if args.print_graph:
        out.print(str(graph), markup=False, highlight=False)
    _summary(graph, seconds, out)
    return 0


def _summary(graph: Graph, seconds: float, out: Console) -> None:
    out.print(
        f"[bold]{escape(graph.name)}[/]: {len(graph)} ops, {graph.num_params:,} parameters, "
        f"captured with {graph.frontend} in {seconds:.1f} s"
    )
    missing = graph.unannotated_ops()
    if not missing:
        out.print("every op has a signature: all of them can be partitioned")
        return
    table = Table(title=f"{len(missing)} ops without a signature (replicate-only)")
    for column in ("op", "kind", "source"):
        table.add_column(column)
    for op in missing:
        table.add_row(op.name, op.kind, str(op.source or ""))
    out.print(table)
    out.print("Give them one with @chronotope.register_op('<signature>').")


COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {"capture": cmd_capture}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chronotope",
        description="Turn a single-device PyTorch model into a distributed training program.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capture", help="capture a model's training step as an operator graph")
    _model_args(cap)
    cap.add_argument("--frontend", choices=("auto", "fx", "export"), default="auto",
                     help="tracer to use (auto: torch.fx, then torch.export if fx fails)")
    cap.add_argument("--print-graph", action="store_true", help="list every op")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = Console(stderr=args.json)
    try:
        return COMMANDS[args.command](args, out)
    except ChronotopeError as e:
        if args.debug:
            traceback.print_exc()
        Console(stderr=True).print("[bold red]error:[/]", Text(str(e)))
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
