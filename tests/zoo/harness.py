"""Every zoo family under every policy, trained two steps and compared with one device.

Each (family, policy) ends in one of three ways: ``ok`` (losses and final weights
within the tolerance of the one-device run), ``mismatch`` (it trained, to other
numbers), or ``error`` (the stage that raised and the first line of why).

    python -m tests.zoo [--families opt vit] [--policies dp tp] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import partial

import torch
from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.graph.axes import carried_dim, carry
from chronotope.graph.ir import Graph, Op, PTensor, TensorKind
from chronotope.policies import ParallelConfig, make
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim, RunResult, run_in_threads
from chronotope.runtime.reference import compare, train_reference
from chronotope.workload import Workload
from tests.zoo.models import FAMILIES

STEPS = 2
OPTIM = Optim("sgd", 0.1)
TOLERANCE = 1e-5  # float32 rounding of the same sums in another order
DEVICES = 2
TIMEOUT = 30.0  # seconds a rank waits on a message: a deadlock ends as an error

TRANSPORTS: dict[str, Callable[..., RunResult]] = {
    "threads": run_in_threads,  # every rank a thread of this process
    "gloo": run_processes,  # every rank a process, as `chronotope run` trains
    # as gloo, each rank's forward regions through torch.compile's AOTAutograd (--compile)
    "compiled": partial(run_processes, compile="aot_eager"),
}

POLICIES: dict[str, ParallelConfig] = {
    "dp": ParallelConfig("dp", DEVICES),
    "tp": ParallelConfig("tp", DEVICES),
    "zero-3": ParallelConfig("zero-3", DEVICES),
    "1f1b": ParallelConfig("1f1b", DEVICES, micro=2, fold=False),
    "1f1b-fold": ParallelConfig("1f1b", DEVICES, micro=2),
    # context parallel: every op along the sequence, attention's keys gathered (whole, or
    # landing round a ring) or its heads cut (ulysses), over 2 and 4 ranks
    "cp": ParallelConfig("cp", DEVICES),
    "cp-4": ParallelConfig("cp", 4),
    "ring-4": ParallelConfig("cp", 4, cp_attention="ring"),
    "ulysses-4": ParallelConfig("cp", 4, cp_attention="ulysses"),
    # expert parallel: each MoE layer's experts shared out over the data-parallel ranks
    "ep": ParallelConfig("dp", DEVICES, ep=DEVICES),
    "ep-4": ParallelConfig("dp", 4, ep=4),
}


@dataclass(frozen=True)
class Family:
    """What capture made of a family: a plan can split only what has a signature."""

    name: str
    ops: int = 0
    unsigned: tuple[str, ...] = ()  # kinds of the ops without a signature (replicate-only)
    whole_batch: tuple[str, ...] = ()  # ops of the model that lose the batch dim: under
    # a batch split every rank runs them on the whole batch
    error: str | None = None  # the capture error, if capture failed


@dataclass(frozen=True)
class Outcome:
    family: str
    policy: str
    status: str  # ok, mismatch, refused (a reason, before running), error
    loss_rel_diff: float | None = None
    param_rel_diff: float | None = None
    stage: str | None = None  # capture, plan, compile or run: where it was refused or failed
    error: str | None = None  # "ExceptionType: first line of its message"
    seconds: float = 0.0
    warnings: tuple[str, ...] = ()  # first lines of what planning and compiling warned


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def capture(workload: Workload) -> Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(workload)


def whole_batch_ops(graph: Graph) -> list[Op]:
    """The model's ops (they read weights) that read the batch but cannot split it: ops with
    no batch dim reading a tensor that has the batch axis, or one made by such an op. Under
    a batch split every rank runs them on the whole batch. Ops past a reduction over the
    batch (a loss's or a batch norm's sums) read partial sums instead, and are not counted."""
    made_by = {t: op for op in graph.ops for t in op.outputs}
    axis = {t: 0 for t in graph.inputs if t.shape}  # tensors with the batch axis, and where
    lost: set[PTensor] = set()  # tensors made whole from the batch by an op that cannot split
    weighted: set[Op] = set()  # ops that read the weights, directly or through other ops
    out = []
    for op in graph.ops:
        if any(t.kind is TensorKind.PARAM or made_by.get(t) in weighted for t in op.inputs):
            weighted.add(op)
        dim = carried_dim(op, axis)
        if dim is not None:
            carry(op, dim, axis)
        elif any(t in axis or t in lost for t in op.inputs):
            lost.update(op.outputs)
            if op in weighted and any(t.shape for t in op.outputs):
                out.append(op)
    return out


def describe(name: str, graph: Graph) -> Family:
    return Family(name, len(graph.ops), tuple(sorted({op.kind for op in graph.unannotated_ops()})),
                  tuple(op.name for op in whole_batch_ops(graph)))


def check(family: str, policy: str, graph: Graph, transport: str = "threads",
          tolerance: float = TOLERANCE, factory: Callable[[], Workload] | None = None
          ) -> Outcome:
    """Plan, compile and train ``family`` (made by ``factory``, the zoo's by default) under
    ``policy``, against one device."""
    factory = factory or FAMILIES[family]
    start = time.perf_counter()
    stage = "plan"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            plan = make(graph, POLICIES[policy])
            stage = "compile"
            program = ct.compile(plan)
            stage = "run"
            run = TRANSPORTS[transport](program, factory(), STEPS, OPTIM, timeout=TIMEOUT)
        except Exception as e:  # noqa: BLE001  (recorded: the table shows every failure)
            # a plan refused with a reason before anything ran is an answer, not a failure
            refused = isinstance(e, ct.ChronotopeError) and stage != "run"
            return Outcome(family, policy, "refused" if refused else "error", stage=stage,
                           error=first_line(e), seconds=time.perf_counter() - start,
                           warnings=said(warned))
    diff = compare(run, train_reference(factory(), STEPS, OPTIM))
    return Outcome(family, policy, "ok" if diff.within(tolerance) else "mismatch",
                   diff.max_loss_rel_diff, diff.max_param_rel_diff,
                   seconds=time.perf_counter() - start, warnings=said(warned))


def said(warned: list[warnings.WarningMessage]) -> tuple[str, ...]:
    """chronotope's own warnings, one line each (torch's and the libraries' left out)."""
    return tuple(dict.fromkeys(
        str(w.message).splitlines()[0] for w in warned
        if "chronotope" in w.filename and str(w.message).strip()))


def run_zoo(families: Iterable[str], policies: Sequence[str], transport: str = "threads",
            report: Callable[[Outcome], None] = lambda o: None
            ) -> tuple[list[Family], list[Outcome]]:
    """Each family captured once, then every policy in turn."""
    described, outcomes = [], []
    for family in families:
        start = time.perf_counter()
        try:
            graph = capture(FAMILIES[family]())
        except Exception as e:  # noqa: BLE001
            described.append(Family(family, error=first_line(e)))
            failed = [Outcome(family, p, "error", stage="capture", error=first_line(e),
                              seconds=time.perf_counter() - start) for p in policies]
            outcomes += failed
            for o in failed:
                report(o)
            continue
        described.append(describe(family, graph))
        for policy in policies:
            outcome = check(family, policy, graph, transport)
            outcomes.append(outcome)
            report(outcome)
    return described, outcomes


def cell(o: Outcome) -> str:
    if o.status in ("error", "refused"):
        color = "red" if o.status == "error" else "yellow"
        return f"[{color}]{o.status} at {o.stage}: {o.error[:90]}[/{color}]"
    text = f"loss {o.loss_rel_diff:.1e}\nparam {o.param_rel_diff:.1e}"
    if o.warnings:
        text += f"\n{len(o.warnings)} warning(s)"
    return text if o.status == "ok" else f"[yellow]mismatch\n{text}[/yellow]"


def table(families: list[Family], outcomes: list[Outcome], policies: Sequence[str],
          transport: str) -> Table:
    out = Table(title=f"zoo: {STEPS} steps on {DEVICES} ranks ({transport}) vs one device "
                      f"(ok <= {TOLERANCE:g})", show_lines=True)
    for column in ("family", "ops", "without signature", *policies):
        out.add_column(column, overflow="fold", max_width=32)
    by_family: dict[str, dict[str, Outcome]] = {}
    for o in outcomes:
        by_family.setdefault(o.family, {})[o.policy] = o
    for f in families:
        row = by_family[f.name]
        passed = sum(o.status == "ok" for o in row.values())
        ops = f"{f.ops}\n{len(f.whole_batch)} whole-batch" if f.ops else "-"
        out.add_row(f"{f.name}\n{passed}/{len(row)} ok", ops, ", ".join(f.unsigned),
                    *(cell(row[p]) for p in policies))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The model zoo under every policy, vs one device.")
    p.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    p.add_argument("--transport", choices=list(TRANSPORTS), default="threads")
    p.add_argument("--json", action="store_true", help="one JSON list of outcomes on stdout")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # tiny models: more threads only contend
    err = Console(stderr=True)
    families, outcomes = run_zoo(args.families, args.policies, args.transport,
                       lambda o: err.print(f"{o.family} {o.policy}: {o.status} "
                                           f"({o.seconds:.1f}s)", highlight=False))
    if args.json:
        print(json.dumps({"families": [asdict(f) for f in families],
                          "outcomes": [asdict(o) for o in outcomes]}, indent=1))
    else:
        console = Console()
        console.width = max(console.width, 200)  # a wide table, also when piped
        console.print(table(families, outcomes, args.policies, args.transport))
    return 0 if all(o.status in ("ok", "refused") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
