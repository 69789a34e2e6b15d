"""The ``chronotope`` command line."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import math
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TextIO

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from chronotope import bench
from chronotope.compile import COMMS, Program
from chronotope.compile import compile as compile_plan
from chronotope.compile.buckets import BUCKET_MB
from chronotope.compile.rvd_search import p2p, search
from chronotope.compile.simulate import simulate
from chronotope.cost.network import ClusterError, cluster_for, load_cluster
from chronotope.errors import ChronotopeError, PlanError
from chronotope.graph import Graph, capture
from chronotope.graph.batch import Batch
from chronotope.graph.convert import torch_random
from chronotope.graph.verify import CHECK_UP_TO, skipped
from chronotope.measure import calibrate, measure_ops
from chronotope.measure.profile import profile, save_profile
from chronotope.models import Workload, default_device, load_function, load_workload
from chronotope.plan import Plan
from chronotope.plan.check import format_bytes
from chronotope.plan.files import load_plan, replicas_of
from chronotope.policies import POLICIES, ParallelConfig, make, timeline
from chronotope.policies.config import FLAGS
from chronotope.policies.context import VARIANTS
from chronotope.runtime.data import example_batches
from chronotope.runtime.launch import Interrupted, run_processes
from chronotope.runtime.metrics import JsonlLog, TensorBoardLog, read_jsonl
from chronotope.runtime.optim import LR_SCHEDULES, Optim, resolve_class
from chronotope.runtime.precision import DTYPES, REDUCE_DTYPES, Precision
from chronotope.runtime.reference import compare, train_reference
from chronotope.schedule import apply, schedule, tune
from chronotope.search import METHODS, Constraints, explain
from chronotope.search import search as find_plan
from chronotope.viz import plot_losses, save_timeline

EXIT_USAGE = 2
EXIT_MISMATCH = 1

Emit = Callable[[Any], None]  # takes the --json report; main writes it to stdout


def positive_int(text: str) -> int:
    """A count (devices, steps, micro-batches ...): 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A rate, a duration or a norm: more than 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of at least 0, got {text!r}")
    return value


def optimizer_name(text: str) -> str:
    """--optimizer: a torch.optim class's name, or an import path to one."""
    try:
        resolve_class(text, torch.optim, "optimizer")
    except ChronotopeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def schedule_name(text: str) -> str:
    """--lr-schedule: constant, cosine, or a torch.optim.lr_scheduler class."""
    if text not in LR_SCHEDULES:
        try:
            resolve_class(text, torch.optim.lr_scheduler, "learning-rate schedule")
        except ChronotopeError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return text


def json_object(text: str) -> dict[str, Any]:
    """--optimizer-args and --lr-schedule-args: keyword arguments as a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        example = '{"betas": [0.9, 0.95]}'
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{example}', got "
                                         f"{text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r}")
    return value


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file {text!r}")
    return text


def schedule_spec(text: str) -> str:
    """--schedule: a pipeline order FILE.csv, or a module schedule FILE.py:fn."""
    if _module_schedule(text):
        existing_file(text.rpartition(":")[0])
        if not text.rpartition(":")[2].isidentifier():
            raise argparse.ArgumentTypeError(f"{text!r}: expected FILE.py:function")
        return text
    return existing_file(text)


def knob_value(text: str) -> tuple[str, Any]:
    """--knob NAME=VALUE: the value as a Python literal (2, 0.5, True, 'x'), or the text."""
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def _module_schedule(spec: str | None) -> bool:
    return bool(spec) and spec.rpartition(":")[0].endswith(".py")


def new_file(text: str) -> str:
    """A file to write: checked before the work that ends by writing it."""
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"cannot write {text!r}: " + ("it is a folder" if path.is_dir()
                                          else f"no folder {str(path.parent)!r}"))
    return text


def timeline_file(text: str) -> str:
    if Path(text).suffix not in (".png", ".html"):
        raise argparse.ArgumentTypeError(f"cannot draw a timeline into {text!r}: "
                                         "use a .png or .html file")
    return new_file(text)


def weights_file(text: str) -> str:
    if Path(text).suffix not in (".pt", ".pth", ".bin", ".safetensors"):
        raise argparse.ArgumentTypeError(f"cannot write weights into {text!r}: use a .pt or "
                                         ".safetensors file")
    return new_file(text)


def png_file(text: str) -> str:
    if Path(text).suffix != ".png":
        raise argparse.ArgumentTypeError(f"cannot draw into {text!r}: use a .png file")
    return new_file(text)


def new_folder(text: str) -> str:
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: it is a file")
    return text


def mesh_shape(text: str) -> tuple[int, ...]:
    """``2x4``: a device mesh of two axes."""
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no mesh: write axis sizes as 2x4")
    return shape


def cluster_spec(text: str) -> str:
    """A cluster preset or profile file that loads."""
    try:
        load_cluster(text)
    except ClusterError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def device_name(text: str) -> str:
    """cpu, meta, or a CUDA device this machine has."""
    try:
        kind = torch.device(text).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "meta", "cuda"):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu, meta or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here")
    return text


def _model_positional(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="gpt",
                   help="a built-in name or path/to/file.py:factory (default: gpt)")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a built-in name (e.g. gpt, llama, gpt3-175b) or "
                   "path/to/file.py:factory")
    p.add_argument("--device", default=None, type=device_name,
                   help="where to build the model: cpu, or meta to capture without allocating "
                   "weights (default: meta for the large presets, cpu otherwise)")
    _common_args(p, model=True)


def _common_args(p: argparse.ArgumentParser, model: bool) -> None:
    if model:
        p.add_argument("--batch-size", "--global-batch", type=positive_int, default=None,
                       help="samples in the example batch: the global batch one step "
                            "trains on, over all devices (default: the model's own)")
        p.add_argument("--check-up-to", type=int, default=CHECK_UP_TO, metavar="PARAMS",
                       help="capture runs its graph and the model as written once each on "
                            "the example batch and refuses a difference, for models up to "
                            "this many parameters (default %(default)s; 0: never)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def cmd_capture(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    start = time.perf_counter()
    device = args.device or default_device(args.model)
    workload = load_workload(args.model, device=device, batch_size=args.batch_size)
    graph = _captured(workload, args, args.frontend)  # its unannotated ops are listed below
    seconds = time.perf_counter() - start
    checked = not skipped(workload.model, Batch.of(workload.inputs, workload.kwargs,
                                                   workload.targets).tensors(), args.check_up_to)
    unannotated = [
        {"op": op.name, "kind": op.kind, "source": str(op.source) if op.source else None}
        for op in graph.unannotated_ops()
    ]
    if args.json:
        emit({
            "model": args.model, "num_ops": len(graph), "num_params": graph.num_params,
            "unannotated_ops": unannotated, "frontend": graph.frontend,
            "capture_s": round(seconds, 3), "checked": checked,
        })
        return 0
    if args.print_graph:
        out.print(str(graph), markup=False, highlight=False)
    _summary(graph, seconds, out)
    out.print("the graph's loss, gradients and buffer updates equal the model's own on the "
              "example batch" if checked else "not run against the model (meta device, or "
              "above --check-up-to parameters)")
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


def _config(args: argparse.Namespace) -> ParallelConfig:
    """--policy and the options that shape it (``policies.make`` checks them)."""
    return ParallelConfig(args.policy, args.devices, args.tp, args.pp, args.micro, args.chunks,
                          args.coshard, args.recompute, args.swap, args.fold, args.schedule,
                          args.cp, args.cp_attention, args.ep)


def _plan(graph: Graph, args: argparse.Namespace, workload: Workload
          ) -> tuple[Plan, Workload]:
    """The plan of --plan FILE, of a module schedule (--schedule FILE.py:fn), or of
    --policy, and the workload it runs (a schedule's ``replace`` swaps modules in a copy);
    its errors say which options asked for it."""
    plan, workload = _planned(graph, args, workload)
    if getattr(args, "dtype", None):
        plan.dtype = args.dtype
    args.dtype = plan.dtype  # what run and train compute in
    if getattr(args, "optimizer", None):  # run and train: the memory of the state they keep
        plan.optimizer = _optim(args).states
    return plan, workload


def _planned(graph: Graph, args: argparse.Namespace, workload: Workload
             ) -> tuple[Plan, Workload]:
    if args.plan:
        plan = load_plan(graph, args.plan)
        args.policy, args.devices = Path(args.plan).name, plan.ndevices  # for the reports
        return plan, workload
    if _module_schedule(args.schedule):
        return _scheduled(graph, args, workload)
    if args.knob:
        raise PlanError("--knob sets a knob of a module schedule: give --schedule FILE.py:fn")
    try:
        return make(graph, _config(args), FLAGS), workload
    except PlanError as e:
        raise PlanError(f"--policy {args.policy} on --devices {args.devices}: {e}") from e


def _scheduled(graph: Graph, args: argparse.Namespace, workload: Workload
               ) -> tuple[Plan, Workload]:
    """``fn(sch)`` of --schedule FILE.py:fn on the model's root schedule, lowered."""
    sch = schedule(workload, devices=args.devices, graph=graph, knobs=dict(args.knob or []))
    apply(load_function(args.schedule), sch)
    args.policy = f"schedule {Path(args.schedule).name}"  # for the reports
    return sch.plan(), sch.workload


def _captured(workload: Workload, args: argparse.Namespace, frontend: str = "auto") -> Graph:
    """The workload's graph, without capture's warnings: the commands report what matters
    of them (`capture` lists the ops without a signature, the plans name what they could
    not split)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(workload, frontend=frontend,
                       check_up_to=getattr(args, "check_up_to", CHECK_UP_TO))


def _compiled(args: argparse.Namespace, device: str = "cpu") -> tuple[Workload, Program]:
    return _program(load_workload(args.model, device=device, batch_size=args.batch_size), args)


def _program(workload: Workload, args: argparse.Namespace) -> tuple[Workload, Program]:
    """The plan of ``args`` compiled, and the workload it trains; with --replicas R, made on
    one replica's rows of the batch and scaled to R data-parallel replicas (``plan.scale``)."""
    replicas = args.replicas
    if args.plan and replicas == 1:  # a scaled plan file: made on one replica's rows
        replicas = replicas_of(args.plan)
    captured = workload.replica(replicas) if replicas > 1 else workload
    graph = _captured(captured, args)
    plan, ran = _plan(graph, args, captured)
    if ran is not captured:  # a schedule replaced modules: train its copy of the model
        workload = replace(workload, model=ran.model)
    if args.shard_optimizer and replicas == 1:
        raise PlanError("--shard-optimizer shares the optimizer state out over --replicas: "
                        "give --replicas R (R > 1), or a plan file made with it")
    if args.replicas > 1 or args.shard_optimizer:  # else a --plan file's own scale stands
        plan.scale(replicas, args.shard_optimizer or plan.shard_optimizer)
    return workload, compile_plan(plan, args.comm, args.cluster, args.bucket_mb)


def cmd_plan(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    device = default_device(args.model)  # large presets are planned without their weights
    if args.out and device == "meta":
        raise ChronotopeError(f"{args.model} is built on the meta device (no weights), so its "
                              "program can be planned but not written with --out")
    workload, program = _compiled(args, device)
    _warn_unsplit(program.plan, out)
    from chronotope.runtime.train import save  # torch.distributed.checkpoint: on demand

    files = save(program, workload, args.out, compile=args.compile) if args.out else []
    if args.save_plan:
        program.plan.save(args.save_plan)
    if args.actions:
        _write_actions(program.plan, args.actions)
    checked = program.plan.check()
    ranks = [
        {"rank": r, "ops": len(checked.sequence(r)), "memory_bytes": asdict(checked.memory[r]),
         "received_bytes": program.traffic(r)}
        for r in range(program.ndevices)
    ]
    changes = [{"tensor": c.tensor.name, "region": [list(r) for r in c.box.index],
                "from": str(c.path.src.rvd), "to": str(c.path.dst.rvd), "path": str(c.path)}
               for c in program.changes]
    if args.json:
        emit({"model": args.model, "policy": args.policy, "devices": args.devices,
              "ranks": ranks, "layout_changes": changes, "files": files,
              "plan_file": args.save_plan,
              "replicate_only_ops": len(program.plan.unsplit)})
        return 0
    table = Table(title=f"{args.model}: {args.policy} on {args.devices} devices "
                        "(bytes each rank receives per step, by kind)")
    kinds = [k for k in ranks[0]["received_bytes"]
             if k == "p2p" or any(r["received_bytes"][k] for r in ranks)]
    for col in ("rank", "ops", "memory", *(k.replace("_", "-") for k in kinds)):
        table.add_column(col, justify="right")
    for r in ranks:
        traffic = r["received_bytes"]
        table.add_row(str(r["rank"]), str(r["ops"]), format_bytes(checked.memory[r["rank"]].total),
                      *(format_bytes(traffic[k]) for k in kinds))
    out.print(table)
    if changes:
        paths: dict[str, int] = {}
        for c in changes:
            key = f"{c['from']} -> {c['to']}: {c['path']}"
            paths[key] = paths.get(key, 0) + 1
        out.print(f"{len(changes)} layout changes by searched paths (--comm rvd):")
        for key, n in sorted(paths.items(), key=lambda kv: -kv[1]):
            out.print(f"  {n} x {key}", markup=False, highlight=False)
    if args.save_plan:
        out.print(f"wrote the plan to {args.save_plan}; use it with --plan {args.save_plan} "
                  "(plan, run, simulate, timeline) or ct.load_plan(graph, path)")
    if files:
        out.print(f"wrote {len(files)} files to {args.out}; run them with "
                  f"torchrun --nproc-per-node {args.devices} {args.out}/launch.py")
    return 0


def _write_actions(plan: Plan, path: str) -> None:
    """The plan's pipeline order as torch pipelining's CSV: one row per rank."""
    import csv

    from chronotope.policies import actions

    rows = actions(plan)
    if not rows:
        raise ChronotopeError(f"--actions {path}: the plan has no pipeline steps to write; "
                              "give a pipeline policy (1f1b, gpipe, interleaved, zb1, ...)")
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows.get(rank, []) for rank in range(max(rows) + 1))


def _warn_unsplit(plan: Plan, out: Console) -> None:
    """Name the ops the policy was to split along the batch but could not."""
    if plan.unsplit:
        ops = [f"{op.name} ({op.kind}: {why})" for op, why in plan.unsplit.items()]
        out.print(f"[yellow]warning: {len(ops)} ops cannot split along the batch, so each runs "
                  f"on the whole batch on every rank:[/] {escape(', '.join(ops))}")


def _check_backend(args: argparse.Namespace) -> None:
    gpus = torch.cuda.device_count()
    if args.backend == "nccl" and gpus < args.devices:
        raise ChronotopeError(f"--backend nccl runs one process per GPU: --devices {args.devices} "
                              f"needs {args.devices} GPUs and this machine has {gpus}; use "
                              "--backend gloo")


def _optim(args: argparse.Namespace) -> Optim:
    """The optimizer and learning-rate schedule run and train options describe (betas
    and other sequences come from JSON as lists: torch takes them as tuples)."""
    def tuples(options: dict[str, Any]) -> dict[str, Any]:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}

    schedule = getattr(args, "lr_schedule", "constant")
    return Optim(args.optimizer, args.lr, clip=args.clip,
                 weight_decay=getattr(args, "weight_decay", 0.0), schedule=schedule,
                 warmup=getattr(args, "warmup", 0),
                 min_lr=getattr(args, "min_lr", 0.0),
                 schedule_options=tuples(getattr(args, "lr_schedule_args", None) or {}),
                 **tuples(args.optimizer_args or {}))


def cmd_run(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    _check_backend(args)
    workload, program = _compiled(args)
    _warn_unsplit(program.plan, out)
    optim = _optim(args)
    precision = Precision(args.dtype, args.reduce_dtype)
    with out.status(f"training {args.model} with {args.policy} on {program.plan.world_size} "
                    f"{args.backend} processes for {args.steps} steps"):
        result = run_processes(program, workload, args.steps, optim, backend=args.backend,
                               timeout=args.timeout, precision=precision, compile=args.compile)
        reference = train_reference(workload, args.steps, optim, precision) \
            if args.check else None
    diff = compare(result, reference) if reference else None
    ok = diff.within(precision.tolerance) if diff else None
    code = EXIT_MISMATCH if ok is False else 0
    step_time = sum(result.step_times[1:]) / max(len(result.step_times) - 1, 1)
    # random ops without a counter-based form: no piece or replica draws what one device does
    unmatched = [f"{op.name} ({op.kind}{f' at {op.source}' if op.source else ''})"
                 for op in torch_random(program.plan.graph)]
    unmatched += [f"{name} (in the model, one device)" for name in
                  (reference.unreplayed if reference else [])]
    if args.json:
        emit({
            "policy": args.policy, "devices": args.devices, "replicas": args.replicas,
            "losses": result.losses,
            "reference_losses": reference.losses if reference else None,
            "max_loss_rel_diff": diff.max_loss_rel_diff if diff else None,
            "max_param_rel_diff": diff.max_param_rel_diff if diff else None,
            "max_buffer_rel_diff": diff.max_buffer_rel_diff if diff else None,
            "match": ok, "tolerance": precision.tolerance, "dtype": precision.dtype,
            "step_time_s": step_time, "torch_random_ops": unmatched,
        })
        return code
    table = Table(title=f"{args.model}: {args.policy} on {program.plan.world_size} processes")
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    if reference:
        table.add_column("single device", justify="right")
    for i, loss in enumerate(result.losses):
        row = [str(i), f"{loss:.6f}"] + ([f"{reference.losses[i]:.6f}"] if reference else [])
        table.add_row(*row)
    out.print(table)
    out.print(f"step time {step_time * 1e3:.1f} ms (rank 0, after the first step)")
    if diff:
        out.print(f"largest relative difference from one device: losses "
                  f"{diff.max_loss_rel_diff:.1e}, parameters {diff.max_param_rel_diff:.1e}"
                  + (f", buffers {diff.max_buffer_rel_diff:.1e} " if result.buffers else " ")
                  + ("[green](match)[/]" if ok else "[red](MISMATCH)[/]")
                  + f" at tolerance {precision.tolerance:.0e} ({precision.dtype})")
    if unmatched and args.check:
        out.print(f"[yellow]{len(unmatched)} random ops draw from torch's generator, so their "
                  "pieces and replicas draw other numbers than one device does"
                  f"{'' if ok else ' (a cause of the mismatch)'}:[/] "
                  f"{escape(', '.join(unmatched))}")
    return code


@contextlib.contextmanager
def _phase(out: Console, quiet: bool, what: str) -> Iterator[None]:
    """A phase before the first step, said as it starts and timed as it ends."""
    start = time.perf_counter()
    if not quiet:
        out.print(f"{what} ...")
    yield
    if not quiet:
        out.print(f"  done in {time.perf_counter() - start:.1f} s")


def cmd_train(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    from chronotope.runtime import checkpoint  # torch.distributed.checkpoint: on demand
    from chronotope.runtime.checkpoint import load_weights
    from chronotope.runtime.train import launched, mean_step_time, train

    here = launched()  # one rank of a torchrun job: this process trains its rank
    if here:
        args.devices = args.devices or int(os.environ["WORLD_SIZE"])
        if int(os.environ["RANK"]) != 0:  # rank 0 reports; the others say only what fails
            out = Console(file=io.StringIO())
            args.json = False
            args.metrics = args.tensorboard = None
    else:
        args.devices = args.devices or 4
        _check_backend(args)
    if (args.eval_every or args.eval_batches) and not args.eval_data:
        raise ChronotopeError("--eval-every and --eval-batches say how to evaluate on "
                              "--eval-data FILE.py:fn: give it too")
    with _phase(out, args.json, f"loading {args.model}"):
        workload = load_workload(args.model, device="cpu", batch_size=args.batch_size,
                                 seed=args.seed)
        if args.init:
            load_weights(workload.model, args.init)
    with _phase(out, args.json, f"capturing, planning ({args.policy}) and compiling"):
        workload, program = _program(workload, args)
    _warn_unsplit(program.plan, out)
    optim = _optim(args)
    sinks: list[Any] = [JsonlLog(args.metrics)] if args.metrics else []
    if args.tensorboard:
        sinks.append(TensorBoardLog(args.tensorboard))
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                        TimeRemainingColumn(), console=out, transient=False,
                        disable=args.json or not out.is_terminal)
    task = progress.add_task(f"{program.plan.graph.name}: {args.policy} "
                             f"x{program.plan.world_size}", total=args.steps,
                             status="starting workers")

    def on_step(record: dict[str, Any]) -> None:
        for sink in sinks:
            sink(record)
        rate = record.get("tokens_per_s")
        speed = f"{rate:,.0f} tok/s" if rate else f"{record['samples_per_s']:,.1f} samples/s"
        progress.update(task, completed=record["step"],
                        status=f"loss {record['loss']:.4f}  {speed}")
        evaluated = f", eval loss {record['eval_loss']:.4f}" if "eval_loss" in record else ""
        if args.json:
            emit(record)
        elif evaluated and out.is_terminal:
            progress.console.print(f"step {record['step']}: eval loss "
                                   f"{record['eval_loss']:.4f}")
        elif not out.is_terminal and (record["step"] % args.log_every == 0 or evaluated
                                      or record["step"] in (1, args.steps)):
            out.print(f"step {record['step']}/{args.steps}: loss {record['loss']:.4f}"
                      f"{evaluated}, {speed}")

    continued = _continued_from(args.resume or args.save)
    if continued and not args.json:
        out.print(f"continuing from {continued}")
    if not args.json and not out.is_terminal:
        out.print(f"starting {program.plan.world_size} " +
                  ("ranks ..." if here else "workers ..."))
    try:
        with progress:
            result = train(program, workload, args.data or example_batches(workload),
                           args.steps, optim, accumulate=args.accumulate, seed=args.seed,
                           save=args.save, save_every=args.save_every or 0, resume=args.resume,
                           keep=args.keep or 0, skip_nonfinite=args.skip_nonfinite,
                           eval_data=args.eval_data, eval_every=args.eval_every or 0,
                           eval_batches=args.eval_batches or 0,
                           on_step=on_step, backend=args.backend, timeout=args.timeout,
                           precision=Precision(args.dtype, args.reduce_dtype),
                           compile=args.compile)
    finally:
        for sink in sinks:
            sink.close()
    saved = str(checkpoint.latest(args.save, verify=False)) if args.save else None
    if here and int(os.environ["RANK"]) != 0:
        return 0
    if not result.losses:  # started again after its last step
        if args.json:
            emit({"final_loss": None, "steps": 0, "checkpoint": saved})
        else:
            out.print(f"nothing left to do: {saved} is the run's step {args.steps}")
        return 0
    step_time = mean_step_time(result)
    eval_loss = result.records[-1].get("eval_loss") if result.records else None
    if args.json:
        emit({"final_loss": result.losses[-1] if result.losses else None,
              "eval_loss": eval_loss, "steps": len(result.losses), "step_time_s": step_time,
              "checkpoint": saved})
        return 0
    evaluated = f", eval loss {eval_loss:.4f}" if eval_loss is not None else ""
    out.print(f"{len(result.losses)} steps: final loss {result.losses[-1]:.4f}{evaluated}, "
              f"{step_time * 1e3:.1f} ms per step (rank 0, after the first)")
    if saved:
        out.print(f"checkpoint {saved}: the same command with more --steps continues it; "
                  f"chronotope export {args.save} weights.safetensors writes the weights")
    return 0


def _continued_from(folder: str | None) -> str | None:
    """The checkpoint (and its step) a run given --resume or --save continues from."""
    from chronotope.runtime import checkpoint

    try:
        path = checkpoint.latest(folder, verify=False) if folder else None
    except checkpoint.CheckpointError:
        return None
    return f"{path} (step {checkpoint.run_info(path)['step']})" if path else None


def cmd_export(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    from chronotope.runtime import checkpoint  # torch.distributed.checkpoint: on demand
    from chronotope.runtime.checkpoint import export

    if args.hf:
        from chronotope.runtime.checkpoint import export_hugging_face

        state = export_hugging_face(args.checkpoint, args.out, args.max_shard_size)
        if args.json:
            emit({"checkpoint": str(checkpoint.latest(args.checkpoint, verify=False)),
                  "out": args.out, "tensors": len(state)})
            return 0
        out.print(f"wrote {args.out}: config.json and safetensors weights; load them with "
                  f"from_pretrained({args.out!r})")
        return 0
    try:
        weights_file(args.out)
    except argparse.ArgumentTypeError as e:
        raise ChronotopeError(f"{e} (or a folder with --hf)") from None
    target = Path(args.out)
    partial = target.with_name(target.name + ".partial" + target.suffix)
    state = export(args.checkpoint, partial)  # the old file stays until the new one is whole
    os.replace(partial, target)
    numel = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    if args.json:
        emit({"checkpoint": str(checkpoint.latest(args.checkpoint, verify=False)), "out": args.out,
              "tensors": len(state), "numel": numel})
        return 0
    out.print(f"wrote {len(state)} tensors ({numel:,} numbers) to {args.out}; load them with "
              "model.load_state_dict(torch.load(...)) or safetensors.torch.load_file")
    return 0


def cmd_plot(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    records = read_jsonl(args.metrics)
    if not records:
        raise ChronotopeError(f"{args.metrics} has no step records")
    plot_losses(records, args.out, f"{Path(args.metrics).stem}: loss over {len(records)} steps")
    if args.json:
        emit({"metrics": args.metrics, "out": args.out, "steps": len(records),
              "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"]})
        return 0
    out.print(f"wrote {args.out}: {len(records)} steps, loss {records[0]['loss']:.4f} -> "
              f"{records[-1]['loss']:.4f}")
    return 0


def constraint(text: str) -> tuple[str, str]:
    """``OPS=CUT`` of ``--constrain``."""
    ops, sep, cut = text.partition("=")
    if not sep or not ops or not cut:
        raise argparse.ArgumentTypeError(f"{text!r} is not OPS=CUT, e.g. 'h.*.mlp.*=split b*'")
    return ops, cut


def _constraints(args: argparse.Namespace) -> Constraints:
    """``--constraints FILE`` and every ``--constrain OPS=CUT``, in that order."""
    return Constraints([*Constraints.parse(args.constraints),
                        *Constraints.parse(dict(args.constrain or ()), "--constrain")])


def cmd_search(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    workload = load_workload(args.model, device=default_device(args.model),
                             batch_size=args.batch_size)
    graph = _captured(workload, args)
    cluster = cluster_for(args.devices, args.cluster)
    with out.status(f"searching plans of {graph.name} over {args.devices} devices"):
        result = find_plan(graph, args.devices, cluster,
                           memory=args.memory * 2 ** 30 if args.memory else None,
                           method=args.method, mesh=args.mesh, simulate=args.simulate,
                           constraints=_constraints(args), dtype=args.dtype,
                           replica=lambda r: _captured(workload.replica(r), args))
    if args.out:
        result.plan.save(args.out)
    if args.json:
        emit({"plan": args.out, "method": result.method,
              "predicted_step_s": result.predicted_step_s,
              "peak_memory_bytes": result.peak_memory_bytes, "search_s": result.search_s,
              "variables": result.variables, "candidates": result.candidates,
              "mesh": result.mesh, "explored": result.explored,
              "timings": result.timings, "dtype": result.plan.dtype,
              "simulated": result.simulated,
              **({"explain": explain(result)} if args.explain else {})})
        return 0
    table = Table(title=f"{graph.name} over {args.devices} devices of {cluster.name}: the plan "
                        f"found ({result.method} on mesh {result.mesh}, "
                        f"{result.variables:,} variables, "
                        f"{result.search_s:.2f} s) and the ready-made ones, "
                        + ("simulated" if result.simulated else "by the search's cost model"))
    constrained = bool(args.constraints or args.constrain)
    for col in ("plan", "step ms", "peak memory", "fits",
                *(("constraints",) if constrained else ())):
        table.add_column(col, justify="left" if col in ("plan", "constraints") else "right")
    for c in result.candidates:
        kept = ("breaks " + "; ".join(c["violates"]) if c.get("violates") else
                "binding: " + "; ".join(c["binding"]) if c.get("binding") else
                "none binding" if "binding" in c else "")
        table.add_row(c["plan"], f"{c['predicted_step_s'] * 1e3:.3f}",
                      format_bytes(c["peak_memory_bytes"]), "yes" if c["fits"] else "no",
                      *((kept,) if constrained else ()))
    out.print(table)
    counts: dict[str, int] = {}
    for label in result.choices.values():
        counts[label] = counts.get(label, 0) + 1
    out.print("ops: " + ", ".join(f"{n} {label}" for label, n in
                                  sorted(counts.items(), key=lambda kv: -kv[1])))
    out.print("seconds: " + ", ".join(f"{phase} {s:.2f}" for phase, s in result.timings.items()))
    if args.explain:
        _print_explained(explain(result), out)
    if args.out:
        out.print(f"wrote {args.out}; run it with chronotope run {args.model} --plan {args.out} "
                  "--check")
    return 0


def _print_explained(why: dict[str, Any], out: Console) -> None:
    line = f"plan: {why['layout']} ({why['method']}), {why['dtype']}, {why['devices']:,} devices"
    if why["replicas"] > 1:
        line += f" as {why['replicas']} data-parallel replicas"
    if why["micro_batches"] > 1:
        line += f", {why['micro_batches']} micro-batches folded"
    out.print(line, markup=False, highlight=False)
    for stage, layers in why["stages"].items():
        out.print(f"  stage {stage}: {layers}", markup=False, highlight=False)
    out.print(f"  recomputed ops: {why['recomputed_ops']}; swapped ops: {why['swapped_ops']}; "
              f"storage: {why['storage']}", markup=False, highlight=False)
    b = why["binding"]
    out.print(f"binding: device {b['device']} holds {format_bytes(b['total'])}, most of it "
              f"{b['term']} (" + ", ".join(f"{k} {format_bytes(v)}" for k, v in
                                          b["bytes"].items()) + ")", markup=False,
              highlight=False)
    for r in why["runners_up"]:
        out.print(f"  runner-up: {r['option']} ({r['method']}): step {r['step_s'] * 1e3:.3f} ms"
                  + (f", {format_bytes(r['peak_memory_bytes'])}" if r["peak_memory_bytes"]
                     else ""), markup=False, highlight=False)


def cmd_tune(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    workload = load_workload(args.model, device=default_device(args.model),
                             batch_size=args.batch_size)
    if not _module_schedule(args.schedule):
        raise ChronotopeError(f"--schedule {args.schedule}: tune takes a module schedule, "
                              "FILE.py:fn")
    graph = _captured(workload, args)
    fn = load_function(args.schedule)
    started = time.perf_counter()
    with out.status(f"pricing the knobs of {args.schedule} on {args.devices} devices") as status:
        tuning = tune(fn, workload, args.devices, args.cluster,
                      args.memory * 2 ** 30 if args.memory else None, method=args.method,
                      seed=args.seed, measure=args.measure, graph=graph,
                      progress=lambda p: status.update(f"priced {p.knobs}"))
    seconds = time.perf_counter() - started
    best = tuning.best
    rerun = " ".join(f"--knob {name}={value!r}" for name, value in best.knobs.items())
    if args.json:
        emit({"schedule": args.schedule, "method": tuning.method, "space": tuning.space,
              "priced": len(tuning.points), "seconds": seconds, "cluster": tuning.cluster,
              "best": asdict(best),
              "points": [asdict(p) for p in tuning.ranked()]})
        return 0
    table = Table(title=f"{args.model}: {args.schedule} on {args.devices} devices of "
                        f"{tuning.cluster}, fastest first")
    names = list(best.knobs)
    for col in (*names, "step ms", "peak memory", *(["measured ms"] if args.measure else [])):
        table.add_column(col, justify="right")
    for p in tuning.ranked()[:args.top]:
        cells = [str(p.knobs.get(n, "")) for n in names]
        if p.fits:
            cells += [f"{p.step_time * 1e3:.3f}", format_bytes(p.memory)]
        else:
            cells += [escape(p.refused[:60]), ""]
        if args.measure:
            cells.append(f"{p.measured * 1e3:.1f}" if p.measured is not None else "")
        table.add_row(*cells)
    out.print(table)
    out.print(f"priced {len(tuning.points)} of {tuning.space} points by {tuning.method} in "
              f"{seconds:.1f} s; the best predicted: {best.step_time * 1e3:.3f} ms")
    out.print(f"run it with: chronotope run {args.model} --schedule {args.schedule} "
              f"--devices {args.devices} {rerun}", markup=False, highlight=False)
    return 0


def cmd_timeline(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    workload = load_workload(args.model, device=default_device(args.model),
                             batch_size=args.batch_size)
    plan, ran = _plan(_captured(workload, args), args, workload)
    measured = measure_ops(plan.graph, ran) if args.measure else None
    drawn = timeline(plan, args.flops, measured=measured, bytes_per_s=args.bandwidth or None)
    save_timeline(drawn, args.out, f"{args.model}: {args.policy} on {args.devices} devices")
    if args.json:
        emit({"model": args.model, "policy": args.policy, "devices": args.devices,
              "bubble_ratio": drawn.bubble_ratio, "makespan_s": drawn.makespan,
              "measured": bool(args.measure), "file": args.out})
        return 0
    how = "from each op's time measured here" if args.measure else \
        f"estimated at {args.flops:.0e} FLOP/s"
    out.print(f"{args.model}: {args.policy} on {args.devices} devices: step "
              f"{drawn.makespan * 1e3:.3f} ms {how}, bubble ratio {drawn.bubble_ratio:.1%}; "
              f"wrote {args.out}")
    return 0


def cmd_order(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    from chronotope.search.order import search_order

    if args.plan or _module_schedule(args.schedule):
        raise ChronotopeError("order searches the order of a --policy pipeline (1f1b, zb1, "
                              "zbv, chimera, 3f1b, ...), not of --plan or a module schedule")
    workload = load_workload(args.model, device=default_device(args.model),
                             batch_size=args.batch_size)
    graph = _captured(workload, args)
    measured = measure_ops(graph, workload) if args.measure else None
    limit = args.limit[0] if args.limit and len(args.limit) == 1 else args.limit
    try:
        found = search_order(graph, _config(args), limit=limit, seconds=args.seconds,
                             flops_per_s=args.flops, measured=measured,
                             bytes_per_s=args.bandwidth or None)
    except PlanError as e:
        raise PlanError(f"--policy {args.policy} on --devices {args.devices}: {e}") from e
    found.order.write(args.out)
    solved = found.solved
    if args.json:
        emit({"model": args.model, "policy": args.policy, "devices": args.devices,
              "status": solved.status, "search_s": solved.seconds,
              "makespan_s": found.makespan, "bubble_ratio": found.bubble,
              "given_makespan_s": found.given_makespan, "given_bubble_ratio": found.given_bubble,
              "bound_s": solved.bound, "kept": found.kept, "limit": found.limit,
              "file": args.out})
        return 0
    table = Table(title=f"{args.model}: {args.policy} on {args.devices} devices")
    for col in ("order", "step ms", "bubble", "micro-batches kept per rank"):
        table.add_column(col, justify="right")
    for name, ms, bubble, kept in (
            (f"{args.policy}'s own", found.given_makespan, found.given_bubble, found.given_kept),
            (f"searched ({solved.status})", found.makespan, found.bubble, found.kept)):
        table.add_row(name, f"{ms * 1e3:.3f}", f"{bubble:.1%}",
                      " ".join(str(kept[r]) for r in sorted(kept)))
    out.print(table)
    how = "from each op's time measured here" if args.measure else \
        f"estimated at {args.flops:.0e} FLOP/s"
    out.print(f"searched in {solved.seconds:.1f} s, steps {how}; no order takes under "
              f"{solved.bound * 1e3:.3f} ms within the limit of "
              f"{' '.join(str(found.limit[r]) for r in sorted(found.limit))} micro-batches "
              f"per rank; wrote {args.out}")
    given = (("micro", args.micro), ("chunks", args.chunks), ("batch-size", args.batch_size))
    rerun = f"chronotope run {args.model} --policy {args.policy} --devices {args.devices}" + \
        "".join(f" --{k} {v}" for k, v in given if v) + f" --schedule {args.out}"
    out.print(f"run it with: {rerun}", markup=False, highlight=False)
    return 0


def cmd_bench(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    cluster = load_cluster(args.cluster)
    if cluster.nodes < 2 and cluster.per_node < 12:
        raise ClusterError(f"--cluster {args.cluster} has one node; the RVD cases put "
                           f"producers and consumers on two nodes: use e.g. {args.cluster}x2")
    cases = bench.rvd_cases(cluster, args.numel)
    if args.measure:
        cases += bench.rvd_cases(cluster, args.numel, same_devices=True)
        small = [{**c, "paths": _resized(c["paths"], args.measure_numel, cluster)}
                 for c in cases]
        inter = [c for c in small if "->" in c["case"]]
        intra = [c for c in small if "->" not in c["case"]]
        with out.status("running the layout changes on gloo processes"):
            bench.measure(inter, args.measure_numel, args.repeats)
            bench.measure(intra, args.measure_numel, args.repeats, dtensor=True)
        for case, measured in zip(cases, inter + intra):
            case.update({k: v for k, v in measured.items() if k.endswith("measured_s")})
    if args.json:
        emit([bench.public(c) for c in cases])
        return 0
    table = Table(title=f"layout changes of {args.numel:,} float32 on {cluster.name}: "
                        f"plain messages (P2P) vs the searched RVD path, cost model")
    for col in ("case", "P2P ms", "RVD ms", "speedup", "path"):
        table.add_column(col, justify="left" if col in ("case", "path") else "right")
    if args.measure:
        for col in ("P2P meas. ms", "RVD meas. ms", "DTensor meas. ms"):
            table.add_column(col, justify="right")
    for c in cases:
        row = [c["case"], f"{c['p2p_s'] * 1e3:.2f}", f"{c['rvd_s'] * 1e3:.2f}",
               f"{c['speedup']:.1f}x", c["path"]]
        if args.measure:
            row += [f"{c[k] * 1e3:.2f}" if k in c else "-" for k in
                    ("p2p_measured_s", "rvd_measured_s", "dtensor_measured_s")]
        table.add_row(*row)
    out.print(table)
    wins = [c for c in cases if "->" in c["case"] and c["speedup"] > 1.001]
    best = max((c["speedup"] for c in wins), default=1.0)
    out.print(f"RVD beats P2P in {len(wins)} of 18 cases, by up to {best:.0f}x "
              f"(SuperScaler: {bench.PAPER_WINS})")
    return 0


def cmd_profile(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise ChronotopeError("--backend nccl needs CUDA devices and there are none here; "
                              "use --backend gloo")
    with out.status(f"timing collectives on {args.devices} {args.backend} processes"):
        cluster = profile(args.devices, repeats=args.repeats, backend=args.backend)
    save_profile(cluster, args.out)
    if args.json:
        emit(cluster.to_json())
        return 0
    table = Table(title=f"{cluster.name}: seconds = alpha x steps + bytes x share / bandwidth, "
                        f"calls back to back and after {cluster.busy * 1e3:g} ms of compute")
    for col in ("collective", "alpha us", "bandwidth GB/s", "after compute: alpha us",
                "bandwidth GB/s "):
        table.add_column(col, justify="left" if col == "collective" else "right")
    for kind, link in cluster.fitted.items():
        busy = cluster.fitted_busy.get(kind, link)
        table.add_row(kind.replace("_", "-"), f"{link.alpha * 1e6:.1f}",
                      f"{link.bandwidth / 1e9:.3f}", f"{busy.alpha * 1e6:.1f}",
                      f"{busy.bandwidth / 1e9:.3f}")
    out.print(table)
    out.print(f"matmul {cluster.peak() / 1e9:.1f} GFLOP/s per device, copies "
              f"{cluster.copy_bandwidth / 1e9:.1f} GB/s; wrote {args.out} (use it as "
              f"--cluster {args.out})")
    return 0


def cmd_simulate(args: argparse.Namespace, out: Console, emit: Emit) -> int:
    workload, program = _compiled(args, default_device(args.model))
    cluster = cluster_for(program.plan.world_size, args.cluster)
    measured, calibration = None, None
    if args.measure:  # as --devices workers sharing this machine's cores run it
        with out.status("timing every op, and the runtime on as many processes"):
            measured = measure_ops(program.plan.graph, workload, processes=program.ndevices)
        calibration = calibrate(program.plan.graph, workload, measured,
                                processes=program.ndevices)
    sim = simulate(program, cluster, measured, calibration=calibration)
    if args.json:
        emit({"model": args.model, "policy": args.policy, "devices": args.devices,
              "cluster": cluster.name, "step_time_s": sim.step_time,
              "bubble_ratio": sim.bubble_ratio,
              "ranks": [asdict(r) for r in sim.ranks]})
        return 0
    dtype = program.plan.dtype
    how = "measured op times" if measured else \
        f"FLOPs at {cluster.peak(dtype) * cluster.efficiency / 1e12:g} TFLOP/s ({dtype}), " \
        f"bytes at {cluster.copy_bandwidth / 1e12:g} TB/s"
    table = Table(title=f"{args.model}: {args.policy} on {args.devices} devices of "
                        f"{cluster.name} ({how}), one step")
    for col in ("rank", "compute ms", "comm ms", "bubble ms", "peak memory"):
        table.add_column(col, justify="right")
    for r in sim.ranks:
        table.add_row(str(r.rank), f"{r.compute * 1e3:.3f}", f"{r.comm * 1e3:.3f}",
                      f"{r.bubble * 1e3:.3f}", format_bytes(r.peak_memory))
    out.print(table)
    out.print(f"predicted step time {sim.step_time * 1e3:.3f} ms, bubble ratio "
              f"{sim.bubble_ratio:.1%}")
    return 0


def _resized(paths: tuple, numel: int, cluster) -> tuple:
    """The same layout changes on a smaller tensor, searched again."""
    naive, path = paths
    return (p2p(naive.src, naive.dst, (numel,), 4, cluster),
            search(path.src, path.dst, (numel,), 4, cluster))


COMMANDS: dict[str, Callable[[argparse.Namespace, Console, Emit], int]] = {
    "capture": cmd_capture, "plan": cmd_plan, "run": cmd_run, "timeline": cmd_timeline,
    "order": cmd_order,
    "bench": cmd_bench, "profile": cmd_profile, "simulate": cmd_simulate, "train": cmd_train,
    "export": cmd_export, "plot": cmd_plot, "search": cmd_search, "tune": cmd_tune,
}


class _DefaultsShown(argparse.HelpFormatter):
    """Each option's default after its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)".lstrip()


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

    for name, help_ in (("plan", "compile a plan and write each rank's code"),
                        ("run", "train with a plan on local gloo processes"),
                        ("train", "train on your data with a plan, with checkpoints, on local "
                                  "gloo processes"),
                        ("simulate", "predict a plan's step time, communication, bubble and "
                                     "memory per device on a cluster, without running it"),
                        ("timeline", "draw a pipeline plan's steps per rank, with its bubble"),
                        ("order", "search a pipeline's order of steps per rank (CP-SAT) for "
                                  "the least step time within its activation memory; write "
                                  "it as torch pipelining CSV")):
        cmd = sub.add_parser(name, help=help_)
        _model_positional(cmd)
        cmd.add_argument("--policy", choices=list(POLICIES), default="dp",
                         help="dp: data parallel; tp: Megatron tensor parallel; sp: tensor + "
                              "sequence parallel; dp-tp, dp-sp: both on a dp x pp x tp mesh; "
                              "zero-1/2/3: data parallel with sharded optimizer state, "
                              "+ gradients, + weights; gpipe, 1f1b, interleaved, zb1, zbv, "
                              "chimera, 3f1b: pipeline schedules (zb*: zero bubble, backward split "
                              "into input and weight gradients; chimera: a down and an up "
                              "pipeline, each with half the micro-batches; 3f1b: a model "
                              "that runs itself again, recycling passes without gradients); "
                              "csv: a pipeline in the order of --schedule; cp: context "
                              "parallel, every op cut along the sequence over --cp devices; "
                              "coshard: dp-tp "
                              "with --coshard pieces of each attention and MLP per device, "
                              "run one at a time; interlaced: 1F1B with the shared embedding "
                              "(lookups and output head) on every device")
        if name == "train":
            cmd.add_argument("--devices", type=positive_int, default=None,
                             help="(default: 4, or under torchrun its world size)")
        else:
            cmd.add_argument("--devices", type=positive_int, default=4)
        cmd.add_argument("--tp", type=positive_int, default=None,
                         help="tensor-parallel group size of the dp-tp and dp-sp meshes "
                              "(default 2) and inside each zero-* replica (default 1)")
        cmd.add_argument("--pp", type=positive_int, default=None,
                         help="pipeline stages (dp-tp, dp-sp: GPipe order, default 1; the "
                              "pipelines: default --devices, the rest data parallel)")
        cmd.add_argument("--micro", type=positive_int, default=None,
                         help="micro-batches per data-parallel group (gradient accumulation; "
                              "default 1, and for the pipelines up to 2 x stages, as the "
                              "batch allows)")
        cmd.add_argument("--fold", action=argparse.BooleanOptionalAction, default=None,
                         help="plan, check and compile one micro-batch and run every "
                              "micro-batch from it (compile time independent of --micro; "
                              "the pipelines fold unless --no-fold, but for chimera and 3f1b)")
        cmd.add_argument("--chunks", type=positive_int, default=None,
                         help="stages each pipeline rank holds (interleaved, zbv; default 2)")
        cmd.add_argument("--coshard", type=positive_int, default=None,
                         help="pieces per device of each attention and MLP (coshard; "
                              "default 2)")
        cmd.add_argument("--cp", type=positive_int, default=None,
                         help="context-parallel group: every op cut along the sequence over "
                              "it (cp: default all devices over tp x pp; dp-tp, dp-sp and the "
                              "pipelines: default 1)")
        cmd.add_argument("--ep", type=positive_int, default=None,
                         help="expert parallel: each Mixture-of-Experts layer's experts shared "
                              "out over groups of this many data-parallel replicas (dp, the "
                              "meshes and the pipelines; default 1)")
        cmd.add_argument("--cp-attention", choices=VARIANTS, default=None,
                         help="how attention meets the sequence chunks under --cp: allgather "
                              "(keys and values gathered, causal chunks in a zigzag; default), "
                              "ring (the same, each device's keys and values attended to as "
                              "they land) or ulysses (heads cut over the group, all-to-all)")
        cmd.add_argument("--recompute", choices=("full", "selective"),
                         help="make activations again in backward instead of keeping them: "
                              "full (all but each block's output) or selective (attention); "
                              "not with zero-*")
        cmd.add_argument("--swap", choices=("full", "selective"),
                         help="keep what the same ops save for backward in CPU memory "
                              "instead (activation swap); not with zero-*")
        cmd.add_argument("--plan", metavar="PLAN.json", type=existing_file,
                         help="a plan file (plan --save-plan, plan.save in Python) instead of "
                              "--policy; it says how many devices")
        cmd.add_argument("--schedule", metavar="FILE.csv|FILE.py:fn", type=schedule_spec,
                         help="FILE.py:fn: a module schedule instead of --policy, fn(sch) "
                              "applying shard, sync, checkpoint, cut_pipeline_stage... to the "
                              "model's modules (ct.schedule); FILE.csv: the pipeline order "
                              "for --policy csv, or for a pipeline policy in its shape "
                              "(chronotope order writes one), in torch pipelining's CSV "
                              "format (a row of actions like 0F1, 0B0 or 0I0, 0W0 per rank)")
        cmd.add_argument("--knob", type=knob_value, action="append", metavar="NAME=VALUE",
                         help="the value a module schedule's sch.knob(NAME, ...) takes "
                              "(chronotope tune finds them); repeatable")
        cmd.add_argument("--config", metavar="FILE.toml", type=existing_file,
                         help="options from a TOML file (model = \"gpt\", policy = \"tp\", "
                              "lr = 1e-3, ...; tables only group them); the command line's "
                              "override it")
        if name not in ("timeline", "order"):
            cmd.add_argument("--comm", choices=COMMS, default="rvd",
                             help="rvd: layout changes no single collective does take the "
                                  "cheapest path of collectives under --cluster's cost model; "
                                  "p2p: messages from each reader (default rvd)")
            cmd.add_argument("--cluster", type=cluster_spec, default=None,
                             help="cost model: a preset (dgx1-v100, dgx-a100, h100-sxm; NAMExN "
                                  "for N nodes) or a profile file from `chronotope profile` "
                                  "(default: DGX A100 nodes enough for --devices)")
            cmd.add_argument("--replicas", type=positive_int, default=1,
                             help="run the plan as this many data-parallel replicas of "
                                  "--devices each (plan.scale): made on one replica's rows "
                                  "of the batch, compiled once (default 1)")
            cmd.add_argument("--shard-optimizer", action="store_true",
                             help="with --replicas: each replica keeps and updates 1 / R "
                                  "of every weight's optimizer state (ZeRO-1 over the "
                                  "replicas, as Megatron's distributed optimizer); gradients "
                                  "reduce-scattered, weights all-gathered after the step")
            cmd.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                             help="compute in bf16 or fp16 under autocast, with fp32 master "
                                  "weights and optimizer state (fp16 scales the loss); "
                                  "priced in memory and the 16-bit FLOP rate, and recorded "
                                  "in the plan (default: a --plan file's, else fp32)")
            cmd.add_argument("--bucket-mb", type=positive_float, default=BUCKET_MB,
                             help="gradient reductions start in buckets of this many MiB as "
                                  f"the backward makes them (default {BUCKET_MB:g}, as DDP)")
        _common_args(cmd, model=True)
        if name in ("plan", "run", "train"):
            cmd.add_argument("--compile", nargs="?", const="inductor", default=None,
                             metavar="BACKEND",
                             help="run each rank's forward regions (its ops between two "
                                  "communications) through torch.compile, and their backward "
                                  "with them (default backend: inductor)")
        if name == "plan":
            cmd.add_argument("--out", type=new_folder,
                             help="directory for rank<r>.py files and launch.py")
            cmd.add_argument("--save-plan", type=new_file, metavar="PLAN.json",
                             help="write the plan's decisions to a plan file (--plan reads it)")
            cmd.add_argument("--actions", type=new_file, metavar="FILE.csv",
                             help="write a pipeline plan's order in torch pipelining's CSV "
                                  "format: a row of actions (0F1, 1B0; I and W for split "
                                  "backwards) per rank, as --policy csv --schedule reads it")
        elif name == "simulate":
            cmd.add_argument("--measure", action="store_true",
                             help="compute from each op's time measured here, and the "
                                  "runtime's time per instruction (as --devices processes "
                                  "sharing this machine's cores would run them) instead of "
                                  "FLOPs at the cluster's peak")
        elif name in ("timeline", "order"):
            if name == "timeline":
                cmd.add_argument("--out", required=True, type=timeline_file,
                                 metavar="FILE.png|FILE.html")
            else:
                cmd.add_argument("--out", required=True, type=new_file, metavar="FILE.csv",
                                 help="the order found, in torch pipelining's CSV format "
                                      "(run it with --policy P --schedule FILE.csv)")
                cmd.add_argument("--limit", type=positive_int, nargs="+", metavar="N",
                                 help="the most micro-batches' activations each pipeline rank "
                                      "keeps at once: one for all ranks, or one per rank "
                                      "(default: what the policy's own order keeps)")
                cmd.add_argument("--seconds", type=positive_float, default=10.0,
                                 help="the solver's time limit (default 10)")
            cmd.add_argument("--flops", type=positive_float, default=1e12,
                             help="device speed for the durations, in FLOP/s (default 1e12)")
            cmd.add_argument("--bandwidth", type=non_negative_float, default=1e11,
                             metavar="BYTES_PER_S",
                             help="link speed of the messages between ranks (default 1e11, "
                                  "about one NVLink; 0: messages take no time)")
            cmd.add_argument("--measure", action="store_true",
                             help="durations from each op's forward and backward time measured "
                                  "on this machine (on the model's device), by FLOP share")
        else:
            cmd.add_argument("--steps", type=positive_int, default=3)
            if name == "run":
                cmd.add_argument("--check", action="store_true",
                                 help="also train on one device and compare losses and weights")
            _running_args(cmd)
            if name == "train":
                _train_args(cmd)

    bench_ = sub.add_parser("bench", help="benchmarks: rvd (layout changes, SuperScaler "
                                          "Table 3)")
    bench_.add_argument("what", choices=("rvd",))
    bench_.add_argument("--cluster", type=cluster_spec, default="dgx1-v100x2",
                        help="preset (dgx1-v100, dgx-a100, h100-sxm; NAMExN for N nodes) or a "
                             "profile file from `chronotope profile` (default dgx1-v100x2)")
    bench_.add_argument("--numel", type=positive_int, default=2 ** 26,
                        help="float32 elements of the tensor (default 2**26: 256 MiB)")
    bench_.add_argument("--measure", action="store_true",
                        help="also run every case on gloo processes (up to 16), and DTensor's "
                             "redistribute for the same changes within one device set")
    bench_.add_argument("--measure-numel", type=positive_int, default=2 ** 20,
                        help="float32 elements of the measured tensor (default 2**20)")
    bench_.add_argument("--repeats", type=positive_int, default=5)
    _common_args(bench_, model=False)

    prof = sub.add_parser("profile", help="measure alpha and bandwidth of each collective "
                                          "here and write a cluster profile")
    prof.add_argument("--devices", type=positive_int, default=2,
                      help="processes to measure (default 2)")
    prof.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    prof.add_argument("--out", type=new_file, default="cluster.json",
                      help="profile file to write (default cluster.json)")
    prof.add_argument("--repeats", type=positive_int, default=20,
                      help="calls per size up to 1 MiB, fewer above (default 20)")
    _common_args(prof, model=False)

    sea = sub.add_parser("search", help="find a plan: every op's cut over the devices by an "
                                        "ILP under the cost model, within the memory limit")
    _model_positional(sea)
    sea.add_argument("--devices", type=positive_int, default=4)
    sea.add_argument("--cluster", type=cluster_spec, default=None,
                     help="cost model: a preset (dgx1-v100, dgx-a100, h100-sxm; NAMExN) or a "
                          "profile file (default: DGX A100 nodes enough for --devices)")
    sea.add_argument("--memory", type=positive_float, default=None, metavar="GiB",
                     help="per-device memory limit, by the plan's own estimate (default: "
                          "the cluster's device memory)")
    sea.add_argument("--method", choices=METHODS, default="auto",
                     help="mesh: the mesh policy's degrees, micro-batches, interleaving, "
                          "recompute and sequence parallelism; ilp: the intra-op ILP on every "
                          "mesh and the stage DP's pipelines; drec: recursive halving by a "
                          "symbolic cost (devices a power of two); auto: mesh, and up to 64 "
                          "devices the other two, the fastest (default)")
    sea.add_argument("--mesh", type=mesh_shape, default=None, metavar="AxB",
                     help="search this device mesh only, e.g. 2x4 (default: every factoring "
                          "of --devices into one or two axes)")
    sea.add_argument("--out", type=new_file, metavar="PLAN.json",
                     help="write the plan found (run, plan, simulate take --plan)")
    sea.add_argument("--constrain", type=constraint, action="append", metavar="OPS=CUT",
                     help="ops or modules matching OPS (shell-style) may only be cut as CUT "
                          "says on every mesh axis: 'h.*.mlp.*=split b*', 'lm_head=replicate', "
                          "'kind:embedding=replicate'; repeatable (ILP only)")
    sea.add_argument("--constraints", type=Path, metavar="FILE.toml",
                     help="constraints the plan keeps to: knobs fixed, listed or bounded "
                          "(tp = 4, pp = [2, 4], micro = {min = 8}, coshard = 2, schedule = "
                          "\"zb1\", recompute, swap, sequence, zero) and op cuts under [cuts]; see "
                          "docs/constraints.md")
    sea.add_argument("--simulate", action=argparse.BooleanOptionalAction, default=None,
                     help="compile and simulate the cheapest plans found to pick one, or "
                          "compare them by the search's own cost model (default: simulate "
                          "up to 64 devices)")
    sea.add_argument("--explain", action="store_true",
                     help="say what the plan is (layout, stages and their layers, recompute, "
                          "storage, dtype), what fills its fullest device, and the runners-up")
    sea.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                     help="what the step computes in: priced at the cluster's FLOP rate "
                          "for it, activations as autocast makes them, fp32 master weights "
                          "and optimizer state; recorded in the plan (default fp32)")
    _common_args(sea, model=True)

    tun = sub.add_parser("tune", help="choose a module schedule's knobs (sch.knob) by the "
                                      "simulator's step time, within the memory limit")
    _model_positional(tun)
    tun.add_argument("--schedule", required=True, type=schedule_spec, metavar="FILE.py:fn",
                     help="the schedule function; its sch.knob(name, choices) calls make "
                          "the space")
    tun.add_argument("--devices", type=positive_int, default=4)
    tun.add_argument("--cluster", type=cluster_spec, default=None,
                     help="cost model: a preset or a profile file (default: DGX A100 nodes "
                          "enough for --devices)")
    tun.add_argument("--memory", type=positive_float, default=None, metavar="GiB",
                     help="per-device memory limit; points that need more are pruned")
    tun.add_argument("--method", choices=("auto", "exhaustive", "descent"), default="auto",
                     help="exhaustive: price every point; descent: randomised coordinate "
                          "descent; auto: exhaustive up to 32 points (default)")
    tun.add_argument("--measure", type=int, default=0, metavar="K",
                     help="also train the K best points on local gloo processes and report "
                          "their measured step time")
    tun.add_argument("--top", type=positive_int, default=10, help="rows to show (default 10)")
    tun.add_argument("--seed", type=int, default=0, help="coordinate descent's starts")
    _common_args(tun, model=True)

    exp = sub.add_parser("export", help="one state dict out of a checkpoint, for "
                                        "model.load_state_dict")
    exp.add_argument("checkpoint", help="a checkpoint folder, or a --save folder (its newest)")
    exp.add_argument("out", metavar="OUT.pt|OUT.safetensors|DIR")
    exp.add_argument("--hf", action="store_true",
                     help="write a Hugging Face folder (config.json, safetensors shards and "
                          "their index) that from_pretrained loads, into DIR")
    exp.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                     help="with --hf: the largest weights file")
    _common_args(exp, model=False)

    plot = sub.add_parser("plot", help="draw the loss curve of a --metrics file")
    plot.add_argument("metrics", type=existing_file, metavar="METRICS.jsonl")
    plot.add_argument("--out", type=png_file, default="loss.png", metavar="FILE.png")
    _common_args(plot, model=False)
    for command in sub.choices.values():  # --help shows what each option defaults to
        command.formatter_class = _DefaultsShown
        for action in command._actions:
            if action.help is None and action.option_strings and \
                    action.default not in (None, False, argparse.SUPPRESS):
                action.help = "(default: %(default)s)"
    return p


def _running_args(cmd: argparse.ArgumentParser, backend: str | None = "gloo") -> None:
    """What run and train (and a saved program's launcher) take to run ranks."""
    cmd.add_argument("--optimizer", type=optimizer_name, default="sgd", metavar="NAME",
                     help="a torch.optim optimizer (sgd, adamw, Adam, RMSprop, ...) "
                          "or an import path (my_pkg.Lion, file.py:Lion)")
    cmd.add_argument("--optimizer-args", type=json_object, metavar="JSON",
                     help="its other keyword arguments, e.g. "
                          "'{\"betas\": [0.9, 0.95], \"eps\": 1e-8}'")
    cmd.add_argument("--lr", type=non_negative_float, default=0.1)
    cmd.add_argument("--clip", type=positive_float, default=None, metavar="MAX_NORM",
                     help="clip gradients to this global norm across all ranks")
    cmd.add_argument("--timeout", type=positive_float, default=60.0,
                     help="seconds a rank waits on another before giving up")
    cmd.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, default="fp32",
                     help="what gradients are summed in across ranks")
    cmd.add_argument("--backend", choices=("gloo", "nccl"), default=backend,
                     help="gloo: processes on CPUs; nccl: one process per GPU"
                          + ("" if backend else " (default: nccl where there are GPUs)"))


def _train_args(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--data", metavar="FILE.py:fn",
                     help="a function returning an iterable of batches shaped like the "
                          "example batch (a DataLoader works); every rank reads it "
                          "(default: the example batch, again every step)")
    cmd.add_argument("--eval-data", metavar="FILE.py:fn",
                     help="validation batches, shaped like --data's: their mean loss with "
                          "no gradients and dropout off (eval_loss in the metrics), after "
                          "the last step and every --eval-every steps")
    cmd.add_argument("--eval-every", type=positive_int, default=None, metavar="K",
                     help="evaluate every K steps too (default: after the last step only)")
    cmd.add_argument("--eval-batches", type=positive_int, default=None, metavar="N",
                     help="evaluate on the first N batches of --eval-data (default: one "
                          "whole pass; give N for data that never ends)")
    cmd.add_argument("--accumulate", type=positive_int, default=1, metavar="K",
                     help="batches whose gradients make one optimizer step")
    cmd.add_argument("--weight-decay", type=non_negative_float, default=0.0,
                     help="decoupled weight decay (adamw) or L2 (sgd); never on biases and "
                          "norm scales")
    cmd.add_argument("--lr-schedule", type=schedule_name, default="constant", metavar="NAME",
                     help="learning rate after warmup: constant, cosine down to --min-lr, "
                          "or a torch.optim.lr_scheduler class (StepLR, OneCycleLR, ...) "
                          "with --lr-schedule-args")
    cmd.add_argument("--lr-schedule-args", type=json_object, metavar="JSON",
                     help="the scheduler's keyword arguments, e.g. '{\"step_size\": 100}'")
    cmd.add_argument("--warmup", type=int, default=0, metavar="STEPS",
                     help="steps of linear warmup to --lr")
    cmd.add_argument("--min-lr", type=non_negative_float, default=0.0)
    cmd.add_argument("--seed", type=int, default=0,
                     help="the model's initial weights, the data's order, random ops")
    cmd.add_argument("--init", metavar="WEIGHTS",
                     help="start from these weights: a state dict (.pt, .safetensors), a "
                          "Hugging Face save_pretrained folder or a chronotope checkpoint")
    cmd.add_argument("--save", type=new_folder, metavar="DIR",
                     help="write checkpoints (torch.distributed.checkpoint) into DIR")
    cmd.add_argument("--save-every", type=positive_int, default=None, metavar="K",
                     help="a checkpoint every K steps (default: after the last step only)")
    cmd.add_argument("--log-every", type=positive_int, default=10, metavar="K",
                     help="when stdout is not a terminal (a log file), a line every K steps "
                          "and for the first and the last")
    cmd.add_argument("--skip-nonfinite", action="store_true",
                     help="skip, on every rank, a step whose loss is not finite (default: "
                          "stop the run there, naming the step and its batches)")
    cmd.add_argument("--keep", type=positive_int, default=None, metavar="N",
                     help="keep the newest N checkpoints, removing older ones as new ones "
                          "are complete (default: all)")
    cmd.add_argument("--resume", metavar="DIR",
                     help="continue from the newest complete checkpoint in DIR (written "
                          "under any plan and device count)")
    cmd.add_argument("--metrics", type=new_file, metavar="FILE.jsonl",
                     help="append one JSON line per step (chronotope plot draws them)")
    cmd.add_argument("--tensorboard", type=new_folder, metavar="DIR",
                     help="log loss, learning rate and throughput for TensorBoard")


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[TextIO]:
    """Send what the command prints to stderr, the model's own ``print`` included (in
    this process and in the workers it starts), so stdout holds the JSON reports alone;
    yields the real stdout, for them."""
    stdout = sys.stdout
    stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        on_fd = stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # a stream in place of stdout (a test's)
        on_fd = False
    reports = os.fdopen(os.dup(saved), "w") if on_fd else stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield reports
    finally:
        if on_fd:
            reports.close()
        stdout.flush()
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _printer(stream: TextIO) -> Emit:
    """Each JSON report as one line, as it comes (a long run reports every step)."""
    def emit(report: Any) -> None:
        stream.write(json.dumps(report) + "\n")
        stream.flush()
    return emit


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser().parse_args(argv)
        if getattr(args, "config", None):
            args = _with_config(argv, args.command, args.config)
    except SystemExit as e:  # argparse has printed the usage and the reason, or --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except ChronotopeError as e:  # a config file's option that is not one, or not valid
        return _failed(argparse.Namespace(json="--json" in argv), str(e), "error", EXIT_USAGE)
    out = Console(stderr=args.json)
    shown = warnings.showwarning
    warnings.showwarning = _warning_line
    try:
        with _stdout_to_stderr() if args.json else contextlib.nullcontext(sys.stdout) as real:
            return COMMANDS[args.command](args, out, _printer(real))
    except Interrupted as e:  # Ctrl-C or a scheduler's SIGTERM: said in one line
        return _failed(args, str(e), "interrupted", 128 + e.signum)
    except KeyboardInterrupt:
        return _failed(args, "interrupted", "interrupted", 128 + signal.SIGINT)
    except ChronotopeError as e:
        if args.debug:
            traceback.print_exc()
        return _failed(args, str(e), "error", EXIT_USAGE)
    finally:
        warnings.showwarning = shown


def launch_main(directory: str, steps: int, argv: Sequence[str] | None = None) -> int:
    """A saved program's ``launch.py`` (``plan --out``, ``ct.save``), one rank per process
    under torchrun: the options of ``chronotope train`` but the model and the plan, which
    the program is; ``steps`` unless --steps says otherwise."""
    from chronotope.runtime.train import TrainConfig, train_saved

    p = argparse.ArgumentParser(prog="launch.py", description=f"train the program in "
                                f"{directory} (torchrun --nproc-per-node N launch.py ...)")
    p.add_argument("--steps", type=positive_int, default=steps)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    _running_args(p, backend=None)
    _train_args(p)
    p.set_defaults(save=os.path.join(directory, "checkpoints"))
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    args.json = False
    lead = int(os.environ.get("RANK", 0)) == 0
    sinks: list[Any] = []
    try:
        if args.eval_data:
            raise ChronotopeError("a saved program has no evaluation: train with chronotope "
                                  "train --eval-data, or evaluate an exported checkpoint")
        config = TrainConfig(args.steps, _optim(args), args.accumulate, args.seed, args.save,
                             args.save_every or 0, args.resume, args.timeout,
                             Precision(args.dtype, args.reduce_dtype), args.keep or 0,
                             args.skip_nonfinite)
        if lead:
            sinks = [JsonlLog(args.metrics)] if args.metrics else []
            if args.tensorboard:
                sinks.append(TensorBoardLog(args.tensorboard))

        def on_step(record: dict[str, Any]) -> None:
            print(f"step {record['step']}: loss {record['loss']:.6f}", flush=True)
            for sink in sinks:
                sink(record)

        result = train_saved(directory, args.data, config, args.backend, args.init, on_step)
    except Interrupted as e:
        return _failed(args, str(e), "interrupted", 128 + e.signum)
    except ChronotopeError as e:
        if args.debug:
            traceback.print_exc()
        return _failed(args, str(e), "error", EXIT_USAGE)
    finally:
        for sink in sinks:
            sink.close()
    if lead and args.save and result.losses:
        from chronotope.runtime import checkpoint

        print(f"checkpoint {checkpoint.latest(args.save, verify=False)}", flush=True)
    return 0


def _with_config(argv: list[str], command: str, path: str) -> argparse.Namespace:
    """The options of TOML file ``path`` (keys spelt as the options are, ``-`` or ``_``;
    a table groups keys, but for a JSON option's value), under those the command line
    gives."""
    import tomllib

    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ChronotopeError(f"--config {path}: cannot read it as TOML: {e}") from None
    p = parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    cmd = sub.choices[command]
    actions = {a.dest: a for a in cmd._actions if a.dest not in ("help", "config")}
    # one file may serve plan, run and train: another command's option is left to it
    anywhere = {a.dest: a for c in sub.choices.values() for a in c._actions}
    values: dict[str, Any] = {}

    def take(table: dict[str, Any], where: str) -> None:
        for key, value in table.items():
            dest = key.replace("-", "_")
            option = actions.get(dest, anywhere.get(dest))
            if isinstance(value, dict) and (option is None or option.type is not json_object):
                take(value, f"{where}{key}.")
            elif option is None:
                raise ChronotopeError(f"{path}: {where}{key} is no option of chronotope "
                                      f"(chronotope {command} --help lists {command}'s)")
            elif dest in actions:
                values[dest] = _option_value(option, value, f"{path}: {where}{key}")

    take(data, "")
    cmd.set_defaults(**values)
    return p.parse_args(argv)


def _option_value(action: argparse.Action, value: Any, where: str) -> Any:
    """A config file's value of an option, checked as the command line's would be."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ChronotopeError(f"{where}: expected true or false, got {value!r}")
        return value
    many = action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction)
    items = value if many and isinstance(value, list) else [value]
    out = []
    for item in items:
        if action.type is not None and not isinstance(item, dict):
            try:
                item = action.type(str(item))  # type: ignore[operator]
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise ChronotopeError(f"{where}: {e}") from None
        if action.choices is not None and item not in action.choices:
            raise ChronotopeError(f"{where}: {item!r} is not one of "
                                  f"{', '.join(map(str, action.choices))}")
        out.append(item)
    return out if many else out[0]


def _warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """A warning as one line on stderr, as the errors are: what it says, not where."""
    Console(stderr=True, soft_wrap=True).print("[yellow]warning:[/]", Text(str(message)))


def _failed(args: argparse.Namespace, message: str, kind: str, code: int) -> int:
    """Say why the command stopped: one line on stderr, or under --json one JSON object on
    stdout (``{"error" | "interrupted": message}``)."""
    if args.json:
        _printer(sys.stdout)({kind: message, "exit_code": code})
    elif kind == "error":
        Console(stderr=True, soft_wrap=True).print("[bold red]error:[/]", Text(message))
    else:
        Console(stderr=True, soft_wrap=True).print(Text(message))
    return code


if __name__ == "__main__":
    sys.exit(main())
