"""Training for real: a Program over a stream of batches, in workers that stay up for the run.

Each rank's optimizer state lives as long as the run; the learning rate follows the
optimizer's schedule; a step may accumulate the gradients of several batches; and the
run saves DCP checkpoints every so many steps and resumes from one under any plan.
``train`` starts the workers on this machine and reports each step as it ends;
under torchrun, ``train`` and a saved program (``save``, ``train_saved``) run the same loop,
one rank per process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from chronotope.compile import compile as compile_plan
from chronotope.compile.program import Program
from chronotope.errors import ChronotopeError
from chronotope.graph.ir import Graph
from chronotope.graph.mask import Mask
from chronotope.plan.files import plan_to_dict
from chronotope.runtime import checkpoint
from chronotope.runtime.data import (
    Batches,
    BatchLayout,
    DataError,
    DataSource,
    example_batches,
    fingerprint,
    resolve,
)
from chronotope.runtime.launch import (
    Interrupted,
    Stop,
    die_with,
    group_device,
    rank_device,
    spawn,
)
from chronotope.runtime.local import (
    Rank,
    RankSpec,
    RunResult,
    gather_params,
    model_buffers,
    rank_specs,
    replica_rows,
)
from chronotope.runtime.optim import Optim, Rates
from chronotope.runtime.precision import Precision, check_precision, plan_precision
from chronotope.runtime.targets import check_sendable
from chronotope.runtime.transport import DistTransport
from chronotope.workload import Workload


@dataclass(frozen=True)
class TrainConfig:
    """How long and how to train, and where checkpoints go (picklable, for workers)."""

    steps: int
    optim: Optim = field(default_factory=Optim)
    accumulate: int = 1  # batches whose gradients make one optimizer step
    seed: int = 0  # the data's generators and the random ops' stream
    save: str | None = None  # folder of checkpoints
    save_every: int = 0  # steps between checkpoints; 0: only after the last step
    resume: str | None = None  # a checkpoint (or a folder of them) to continue from
    timeout: float = 60.0
    precision: Precision | None = None  # mixed precision; None: fp32
    keep: int = 0  # the newest checkpoints kept; 0: all
    skip_nonfinite: bool = False  # a step whose loss is not finite: skipped, not fatal
    eval_every: int = 0  # steps between evaluations (with eval data); 0: after the last
    eval_batches: int = 0  # the evaluation data's first batches read; 0: one whole pass

    def __post_init__(self) -> None:
        if self.steps < 1 or self.accumulate < 1 or min(self.save_every, self.keep,
                                                        self.eval_every,
                                                        self.eval_batches) < 0:
            raise ValueError("steps and accumulate must be at least 1, save_every, keep, "
                             "eval_every and eval_batches at least 0")

    def saves_after(self, step: int) -> bool:
        """Whether a checkpoint is written once ``step`` steps are done."""
        return self.save is not None and (
            step == self.steps or (self.save_every > 0 and step % self.save_every == 0))

    def evaluates_after(self, step: int) -> bool:
        """Whether the evaluation data's loss is measured once ``step`` steps are done."""
        return step == self.steps or (self.eval_every > 0 and step % self.eval_every == 0)


@dataclass(frozen=True)
class Job:
    """What every rank needs besides its own spec: how batches look, and what a checkpoint
    holds (each parameter's shape, the model's state-dict names, its persistent buffers)."""

    layout: BatchLayout
    shapes: dict[str, tuple[int, ...]]
    names: dict[str, str]  # every state-dict name -> the name its tensor is saved under
    buffers: tuple[str, ...]
    model: str
    hugging_face: dict[str, Any] | None = None  # a transformers model's class and config

    @classmethod
    def of(cls, program: Program, workload: Workload) -> Job:
        graph = program.plan.graph
        names = checkpoint.state_dict_names(workload.model, list(graph.params))
        buffer_names = {n for n, _ in workload.model.named_buffers()}
        return cls(BatchLayout.of(workload, graph, program.plan.replicas),
                   {n: tuple(p.shape) for n, p in graph.params.items()}, names,
                   tuple(sorted({c for c in names.values() if c in buffer_names})), graph.name,
                   checkpoint.hugging_face(workload.model))

    def info(self, step: int, batches: int) -> dict[str, Any]:
        info = {"format": checkpoint.FORMAT, "model": self.model, "step": step,
                "batches": batches, "state_dict": self.names, "buffers": list(self.buffers)}
        if self.hugging_face:  # what export --hf writes config.json from
            info["hugging_face"] = self.hugging_face
        return info


def start_of(config: TrainConfig, job: Job) -> tuple[Path | None, int]:
    """The checkpoint a run continues from (checked against the model) and its step: the
    one ``resume`` names, else the newest complete one in the ``save`` folder, so that one
    command both starts a run and restarts it after a failure (as torchtitan does)."""
    source = config.resume
    if source is None and config.save is not None and _holds_checkpoints(config.save):
        source = config.save
    if source is None:
        return None, 0
    path = checkpoint.latest(source)
    checkpoint.check_fits(path, job.shapes, list(job.names))
    info = checkpoint.run_info(path)
    step = int(info["step"])
    if info.get("optimizer") not in (None, config.optim.name):
        warnings.warn(f"checkpoint {str(path)!r} was trained with {info['optimizer']}, this run "
                      f"uses {config.optim.name}: the optimizer starts without its state",
                      stacklevel=3)
    if step >= config.steps and config.resume is not None:
        raise ChronotopeError(f"checkpoint {str(path)!r} is at step {step}: a run of "
                              f"{config.steps} steps has nothing left to do (raise --steps)")
    return path, step


def _holds_checkpoints(folder: str) -> bool:
    """Whether ``folder`` has a complete checkpoint (one only begun when a run was stopped
    leaves nothing to continue from; a damaged one is named by ``checkpoint.latest``)."""
    return Path(folder).is_dir() and any(
        (p / ".metadata").is_file() for p in Path(folder).glob("step-*"))


def check_trainable(graph: Graph) -> None:
    """A model with every parameter frozen has nothing to train: said before any work."""
    if graph.params and all(t.frozen for t in graph.params.values()):
        raise ChronotopeError(f"{graph.name} has nothing to train: each of its "
                              f"{len(graph.params)} parameters is frozen (requires_grad=False)")


# ---- one rank ------------------------------------------------------------------------------


def train_loop(spec: RankSpec, job: Job, writes: checkpoint.Writes, data: DataSource,
               config: TrainConfig, resume: Path | None, device: torch.device,
               report: Callable[[dict[str, Any]], None] | None = None,
               eval_data: DataSource | None = None, stop: Stop | None = None,
               init: Path | None = None
               ) -> tuple[list[float], dict, list[float], dict]:
    """One rank's run inside an initialized process group: its losses (rank 0), parameter
    regions, step times and buffers; ``report`` gets rank 0's record of each step, with
    the loss on ``eval_data`` (``eval_loss``) after the steps ``config`` evaluates after."""
    rank = Rank(spec, DistTransport(config.timeout, spec.groups), config.optim, device,
                seed=config.seed, precision=config.precision)
    rates = Rates(config.optim, config.steps)
    start = 0
    if init is not None and resume is None:  # the weights (and buffers) to start from
        checkpoint.load(init, rank, job.shapes)
    if resume is not None:
        info = checkpoint.load(resume, rank, job.shapes, config.optim.name)
        start, rank.steps = int(info["step"]), int(info["batches"])
        rates.load(info.get("lr_schedule"), start)
        if rank.scaler is not None and "loss_scale" in info:
            rank.scaler.scale, rank.scaler.good = info["loss_scale"], info["good_steps"]
    batches = Batches(data, job.layout, config.seed, start=rank.steps)
    losses: list[float] = []
    times: list[float] = []
    # a signal to any rank stops every rank after the same step, with a checkpoint
    with stop or Stop(device) as stop:
        for step in range(start, config.steps):
            begin = time.perf_counter()
            lr = rates.lr
            rates.apply(rank.optimizer)
            rank.zero_grad()
            step_losses, tokens, samples, read = [], 0, 0, batches.read
            for _ in range(config.accumulate):
                index = batches.read
                batch = next(batches)
                _hand(batch, rank, index)
                step_losses += rank.forward_backward()
                tokens, samples = tokens + _tokens(batch), samples + _samples(batch)
            # the gradients' global norm (fp16's are scaled: its loss scaling skips those)
            norm = None if rank.scaler else rank.grad_norm() / config.accumulate
            stopped, bad_loss, bad_norm = stop.agreed(
                not all(map(math.isfinite, step_losses)),
                norm is not None and not math.isfinite(norm))
            bad = bad_loss or bad_norm
            if bad and not config.skip_nonfinite:
                raise ChronotopeError(
                    f"the {'loss' if bad_loss else 'gradient norm'} is not finite at step "
                    f"{step + 1} (batches {read} to {batches.read - 1}): the run stops here; "
                    "lower --lr, check those batches, or skip such steps with "
                    "--skip-nonfinite")
            if bad:
                rank.zero_grad()
            taken = not bad and rank.update(1 / config.accumulate, norm)
            rates.advance(_loss_everywhere(rank, step_losses) if rates.on_metric else None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - begin
            times.append(seconds)
            measured = eval_data is not None and not stopped and config.evaluates_after(
                step + 1)
            eval_loss = evaluate(rank, eval_data, job.layout, config) if measured else None
            if spec.rank == 0:
                loss = sum(step_losses) / len(step_losses)
                losses.append(loss)
                if report:
                    record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm,
                              "step_s": seconds,
                              "samples_per_s": samples / seconds,
                              "tokens_per_s": tokens / seconds if tokens else None}
                    if rank.scaler is not None:  # fp16: the scale
                        record.update(loss_scale=rank.scaler.scale)
                    if rank.scaler is not None or bad:  # whether the step was taken
                        record.update(skipped=not taken)
                    if measured:
                        record.update(eval_loss=eval_loss)
                    report(record)
            if config.saves_after(step + 1) or (stopped and config.save):
                assert config.save is not None
                info = {**job.info(step + 1, rank.steps), "optimizer": config.optim.name,
                        "lr_schedule": rates.state_dict(),
                        "param_groups": config.optim.param_groups(job.shapes, rates.hyper)}
                if rank.scaler is not None:
                    info.update(loss_scale=rank.scaler.scale, good_steps=rank.scaler.good)
                checkpoint.save(config.save, step + 1, rank, writes, job.shapes, info)
                if writes.lead:
                    checkpoint.prune(config.save, config.keep)
            if stopped:
                break
    return losses, rank.regions(), times, {n: t.detach().cpu() for n, t in rank.state.items()}


def _loss_everywhere(rank: Rank, losses: list[float]) -> float:
    """Rank 0's loss of the step (the one reported), on every rank: one all-reduce."""
    mine = sum(losses) / len(losses) if rank.rank == 0 else 0.0
    total = torch.tensor([mine], dtype=torch.float64, device=rank.device)
    if len(rank.world) > 1:
        total = rank.transport.all_reduce(total, rank.world, rank.unit_rank)
    return float(total[0])


def evaluate(rank: Rank, data: DataSource, layout: BatchLayout, config: TrainConfig) -> float:
    """The mean loss of the plan's evaluation over one pass of ``data`` (its first
    ``config.eval_batches``), the same on every rank: each rank adds up the losses it
    holds, and one all-reduce adds up the ranks'."""
    total = torch.zeros(2, dtype=torch.float64, device=rank.device)  # sum, count
    for index, batch in enumerate(Batches(data, layout, config.seed, once=True)):
        _hand(batch, rank, index)
        losses = rank.evaluate()
        total += torch.tensor([sum(losses), len(losses)], dtype=torch.float64,
                              device=rank.device)
        if index + 1 == config.eval_batches:
            break
    if len(rank.world) > 1:
        total = rank.transport.all_reduce(total, rank.world, rank.unit_rank)
    return float(total[0] / total[1])  # an empty pass is a DataError in Batches


def _hand(batch: dict[str, torch.Tensor], rank: Rank, index: int) -> None:
    """Check batch ``index`` (no NaN, the same on every rank) and give ``rank`` its rows."""
    _no_nan(batch, index)
    _same_everywhere(batch, rank, index)
    rank.batch = {n: t.to(rank.device) for n, t in _rows(batch, rank.replica).items()}


def _rows(batch: dict[str, torch.Tensor], replica: tuple[int, int, int] | None
          ) -> dict[str, torch.Tensor]:
    """The rows of a batch a rank reads: a scaled plan's replica, its own."""
    return replica_rows(batch, replica[1], replica[0]) if replica else batch


def _no_nan(batch: Mapping[str, torch.Tensor], index: int) -> None:
    """A NaN in the data is named as one, before it reaches the loss."""
    for name, t in batch.items():
        if t.is_floating_point() and bool(torch.isnan(t).any()):
            at = tuple(torch.nonzero(torch.isnan(t))[0].tolist())
            raise DataError(f"batch {index} has NaN in {name!r} (at {at}): the data set "
                            "holds a value that is not a number")


def _same_everywhere(batch: Mapping[str, torch.Tensor], rank: Rank, index: int) -> None:
    """Every rank read the same batch: its fingerprint is compared across ranks."""
    world = rank.world
    if len(world) < 2:
        return
    mine = fingerprint(batch).to(rank.device)
    every = rank.transport.all_gather(mine, world, rank.unit_rank)
    for other, theirs in zip(world, every):
        if not torch.equal(theirs, every[0]):
            names = list(batch)
            differ = [names[i // 2] for i in range(len(mine)) if theirs[i] != every[0][i]]
            raise DataError(
                f"batch {index} on rank {other} differs from rank 0's (input "
                f"{differ[0] if differ else '?'!r}): every rank reads the data itself, so the "
                "data must give the same batches in the same order on every rank (shuffle "
                "with torch's generator, which chronotope seeds alike everywhere)")


def _tokens(batch: Mapping[str, torch.Tensor]) -> int:
    """Tokens in a batch: the elements of its first integer input of two or more dims."""
    first = next((t for t in batch.values() if not t.is_floating_point() and t.ndim >= 2), None)
    return first.numel() if first is not None else 0


def _samples(batch: Mapping[str, torch.Tensor]) -> int:
    first = next(iter(batch.values()), None)
    return first.shape[0] if first is not None and first.ndim else 1


# ---- all ranks on this machine -------------------------------------------------------------


def _spawned(index: int, specs: list[RankSpec], job: Job, writes: list[checkpoint.Writes],
             data: DataSource, config: TrainConfig, resume: Path | None, backend: str,
             progress: str, eval_data: DataSource | None
             ) -> tuple[list[float], dict, list[float], dict]:
    device = rank_device(backend, index)

    def report(record: dict[str, Any]) -> None:
        with open(progress, "a") as f:
            f.write(json.dumps(record) + "\n")

    return train_loop(specs[index], job, writes[index], data, config, resume, device, report,
                      eval_data)


class _Tail:
    """The complete lines a file has gained since the last call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0

    def __call__(self) -> list[str]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            text = f.read()
        complete = text[:text.rfind("\n") + 1]
        self.offset += len(complete)
        return complete.splitlines()


def train(program: Program, workload: Workload, data: DataSource, steps: int,
          optim: Optim | None = None, *, accumulate: int = 1, seed: int = 0,
          save: str | None = None, save_every: int = 0, resume: str | None = None,
          on_step: Callable[[dict[str, Any]], None] | None = None, backend: str = "gloo",
          timeout: float = 60.0, precision: Precision | None = None,
          compile: str | None = None, keep: int = 0, skip_nonfinite: bool = False,
          eval_data: DataSource | None = None, eval_every: int = 0, eval_batches: int = 0
          ) -> RunResult:
    """Train ``program`` on ``data`` for ``steps`` optimizer steps, one process per rank.

    ``data`` is ``path/to/file.py:fn``, a function returning an iterable of batches, or
    the iterable; a batch is shaped like the example batch (the model's inputs, then
    its targets; or a dict of keyword arguments). ``on_step`` gets rank 0's record of
    each step as it ends (step, loss, lr, grad_norm, step_s, samples_per_s, tokens_per_s;
    under fp16 also loss_scale and skipped). ``precision`` is mixed precision
    (``Precision("bf16")``); ``compile`` a ``torch.compile`` backend for the forward
    regions (``rank_specs``).
    ``save``: a folder this run alone saves into (``checkpoint.lease``), keeping the newest
    ``keep`` checkpoints (0: all). A step whose loss or gradient norm is not finite stops
    the run, naming it and its batches, or with ``skip_nonfinite`` is skipped on every
    rank (``skipped`` in its record). ``eval_data`` (a data source like ``data``): the
    plan's evaluation (``Plan.evaluation``: no gradients, dropout off) over one pass of
    it, or its first ``eval_batches``, every ``eval_every`` steps and after the last;
    its mean loss is ``eval_loss`` in that step's record. Returns the losses of the
    steps run, the final weights and buffers.
    """
    precision = precision or plan_precision(program.plan)
    config = TrainConfig(steps, optim or Optim(), accumulate, seed, save, save_every, resume,
                         timeout, precision, keep, skip_nonfinite, eval_every, eval_batches)
    check_trainable(program.plan.graph)
    resolve(data)  # a data file that does not load is named before any worker starts
    if eval_data is not None:
        resolve(eval_data)
    evaluation = compile_plan(program.plan.evaluation()) if eval_data is not None else None
    check_precision(program.plan.graph, precision, "cuda" if backend == "nccl" else "cpu")
    config.optim.check_plan(program)
    job = Job.of(program, workload)
    resume_path, start = start_of(config, job)
    if start >= config.steps:  # a finished run started again (a restart after its end)
        return RunResult([], {}, [])
    if launched():
        return _train_here(program, workload, job, data, config, resume_path, backend,
                           compile, evaluation, on_step, eval_data)
    specs = rank_specs(program, workload, compile, evaluation)
    check_sendable(specs[0].targets if specs else {})
    writes = checkpoint.plan_writes(program)
    records: list[dict[str, Any]] = []
    with checkpoint.lease(save) if save else contextlib.nullcontext(), \
            tempfile.TemporaryDirectory(prefix="chronotope-train-") as tmp:
        progress = os.path.join(tmp, "progress.jsonl")
        tail = _Tail(progress)

        def watch() -> None:
            for line in tail():
                records.append(json.loads(line))
                if on_step:
                    on_step(records[-1])

        try:
            results = spawn(_spawned, len(specs), (specs, job, writes, data,
                                                   config, resume_path, backend,
                                                   progress, eval_data),
                            backend, timeout, watch)
        except Interrupted as e:
            raise Interrupted(_interrupted(records, save), e.signum) from None
    return RunResult(results[0][0], gather_params([r[1] for r in results], workload),
                     results[0][2], buffers=model_buffers(results[0][3], workload),
                     records=records)


# ---- one rank in this process (torchrun) -----------------------------------------------------


def launched() -> bool:
    """Whether a launcher (torchrun, or one that sets torch's ``env://`` variables) started
    this process as one rank of a job: then ``train`` runs that rank here, spawning none."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _train_here(program: Program, workload: Workload, job: Job, data: DataSource,
                config: TrainConfig, resume: Path | None, backend: str, compile: str | None,
                evaluation: Program | None,
                on_step: Callable[[dict[str, Any]], None] | None,
                eval_data: DataSource | None) -> RunResult:
    """This process's rank of ``train``, under a launcher; every rank planned the same
    program (checked by a digest of the plan)."""
    plan = json.dumps(plan_to_dict(program.plan), sort_keys=True, default=str)

    def made(rank: int) -> tuple[RankSpec, checkpoint.Writes]:
        return (rank_specs(program, workload, compile, evaluation, only=rank)[0],
                checkpoint.plan_writes(program)[rank])

    return run_rank(program.plan.world_size, plan.encode(), made, job, data, config, resume,
                    backend, on_step, eval_data)


def run_rank(ranks: int, program: bytes,
             made: Callable[[int], tuple[RankSpec, checkpoint.Writes]],
             job: Job, data: DataSource, config: TrainConfig, resume: Path | None,
             backend: str, on_step: Callable[[dict[str, Any]], None] | None = None,
             eval_data: DataSource | None = None, init: Path | None = None) -> RunResult:
    """The rank a launcher gave this process, of a program of ``ranks`` ranks (``made``:
    its spec and writes). ``program`` identifies the program: every rank must have the
    same. Rank 0 holds the ``save`` folder's lease and reports each step; the weights are
    in the checkpoints (``RunResult.params`` is empty), and the losses are rank 0's
    (empty on the others). ``init``: a checkpoint the weights start from."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if world != ranks:
        raise ChronotopeError(
            f"the plan has {ranks} ranks but the launcher started {world} processes: start "
            f"{ranks} (torchrun --nnodes N --nproc-per-node K with N x K = {ranks})")
    threading.Thread(target=die_with, args=(os.getppid(),), daemon=True).start()
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group(backend, timeout=timedelta(seconds=config.timeout),
                                device_id=group_device(backend, local))
    held = contextlib.ExitStack()
    try:
        device = rank_device(backend, local)
        _check_same_program(hashlib.sha256(program).hexdigest())
        if config.save:
            _take_lease(config.save, rank, device, held)
            checkpoint.check_shared(config.save)
        spec, writes = made(rank)
        records: list[dict[str, Any]] = []

        def report(record: dict[str, Any]) -> None:
            records.append(record)
            if on_step:
                on_step(record)

        stop = Stop(device)
        losses, regions, times, _ = train_loop(spec, job, writes, data, config, resume,
                                               device, report, eval_data, stop, init)
        dist.barrier()  # every rank done communicating before any tears its group down
    finally:
        held.close()
        if joined and dist.is_initialized():
            dist.destroy_process_group()
    if stop.stopped:
        raise Interrupted(_interrupted(records, config.save), stop.stopped)
    return RunResult(losses, {}, times, records=records, regions=regions)


def _check_same_program(digest: str) -> None:
    """Every rank runs the same program: a search or a random choice that differs between
    processes, or a saved program that differs between nodes, would pair the wrong
    messages, so it is refused here."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    differ = [r for r, d in enumerate(every) if d != every[0]]
    if differ:
        raise ChronotopeError(
            f"rank {differ[0]} has another program than rank 0 (plans differ between "
            "processes, as a search with a time limit may, or a saved program differs between "
            "nodes): make the plan once with `chronotope plan --save-plan FILE` and give every "
            "rank --plan FILE")


def _take_lease(save: str, rank: int, device: torch.device, held: contextlib.ExitStack
                ) -> None:
    """Rank 0 takes the ``save`` folder's lease; every rank stops if it could not."""
    refused = None
    if rank == 0:
        try:
            held.enter_context(checkpoint.lease(save))
        except checkpoint.CheckpointError as e:
            refused = e
    flag = torch.tensor([int(refused is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if refused is not None:
        raise refused
    if flag.item():
        raise ChronotopeError(f"rank 0 could not take the lease of {save!r}")


def _interrupted(records: list[dict[str, Any]], save: str | None) -> str:
    """Where a stopped run got to, and what it left to continue from."""
    done = f"interrupted at step {records[-1]['step'] if records else 0}"
    if save is None:
        return f"{done}; nothing saved (no --save)"
    try:
        path = checkpoint.latest(save, verify=False)
    except checkpoint.CheckpointError:
        return f"{done}; no complete checkpoint in {save!r}"
    return (f"{done}; last complete checkpoint step {checkpoint.run_info(path)['step']} "
            f"({path}): continue with --resume {save}")


def mean_step_time(result: RunResult) -> float:
    """Seconds per step after the first (which warms up)."""
    times = result.step_times[1:] or result.step_times
    return sum(times) / len(times) if times else math.nan


# ---- a saved program, under torchrun ----------------------------------------------------------

PROGRAM = "program.pt"  # what the ranks need besides their code and weights
INIT = "init"  # the weights a saved program starts from: a checkpoint


def save(program: Program, workload: Workload, directory: str, steps: int = 10,
         compile: str | None = None) -> list[str]:
    """Write each rank's module, what the ranks need besides it (``program.pt``: which
    regions each holds and updates, its groups, the example batch; no weights), the
    weights they start from as a checkpoint (``init``), and a ``torchrun`` launcher
    (``compile``: a ``torch.compile`` backend the ranks run their forward regions through).

    ``torchrun --nproc-per-node N DIR/launch.py [--data FILE.py:fn] [--steps S] ...``
    then trains with any option ``chronotope train`` takes, into ``DIR/checkpoints``
    unless ``--save`` says otherwise, from ``init`` unless ``--init`` says otherwise.
    """
    os.makedirs(directory, exist_ok=True)
    specs = rank_specs(program, workload, compile, weights=False)
    check_sendable(specs[0].targets if specs else {})
    paths = []
    for spec in specs:
        path = os.path.join(directory, f"rank{spec.rank}.py")
        with open(path, "w") as f:
            f.write(spec.code)
        paths.append(path)
        spec.code = ""  # the launcher runs the file, so what a reader sees is what runs
    job = Job.of(program, workload)
    torch.save({"specs": specs, "job": job,
                "writes": checkpoint.plan_writes(program),
                "example": example_batches(workload)},
               os.path.join(directory, PROGRAM))
    init = os.path.join(directory, INIT)
    shutil.rmtree(init, ignore_errors=True)
    checkpoint.save_whole(init, {n: p.detach() for n, p in workload.model.named_parameters()},
                          {n: b.detach() for n, b in workload.model.named_buffers()},
                          job.info(0, 0))
    launcher = os.path.join(directory, "launch.py")
    with open(launcher, "w") as f:
        f.write(LAUNCHER.format(n=len(specs), name=program.plan.graph.name, steps=steps))
    return [*paths, init, launcher]


LAUNCHER = '''"""Train {name} on {n} ranks: torchrun --nproc-per-node {n} launch.py [OPTIONS]

Generated by chronotope: rank<r>.py is what rank r runs each step; program.pt what the
ranks need besides it (no weights); init/ the weights they start from (a checkpoint;
--init gives others). Takes the options of `chronotope train` (--help lists them);
checkpoints go into checkpoints/ unless --save says otherwise, and the same command
continues from the newest (chronotope export turns one into a state dict).
"""

import os
import sys

from chronotope.cli import launch_main

if __name__ == "__main__":
    sys.exit(launch_main(os.path.dirname(os.path.abspath(__file__)), steps={steps}))
'''


def train_saved(directory: str, data: DataSource | None, config: TrainConfig,
                backend: str | None = None, init: str | None = None,
                on_step: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    """The rank torchrun gave this process, of the program ``save`` wrote into
    ``directory``: on ``data`` (default: the example batch, every step), from the weights
    of ``init`` (a checkpoint, a state-dict file or a Hugging Face folder; default: the
    program's own ``init``) unless it continues from a checkpoint. The process exits when
    its torchrun agent is gone."""
    if not launched():
        raise ChronotopeError(f"{directory}/launch.py runs under torchrun: torchrun "
                              f"--nproc-per-node N {directory}/launch.py ...")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    path = Path(directory) / PROGRAM
    saved = torch.load(path, weights_only=False)
    specs: list[RankSpec] = saved["specs"]
    job: Job = saved["job"]
    resume, start = start_of(config, job)
    if start >= config.steps:
        return RunResult([], {}, [])
    weights = Path(init) if init else Path(directory) / INIT
    start_from = None if resume else _initial_weights(weights, job)

    def made(rank: int) -> tuple[RankSpec, checkpoint.Writes]:
        spec = specs[rank]
        spec.code = (Path(directory) / f"rank{rank}.py").read_text()
        if isinstance(start_from, dict):  # whole tensors: each region a slice of them
            spec.params = {(name, index): start_from[name][Mask(index).to_slices()].clone()
                           for name, index in spec.params}
            spec.state = {**spec.state, **{n: t for n, t in start_from.items()
                                           if n in spec.state}}
        else:  # filled from the checkpoint by train_loop
            spec.params = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in spec.params.items()}
        return spec, saved["writes"][rank]

    return run_rank(len(specs), path.read_bytes(), made, job, data or saved["example"], config,
                    resume, backend, on_step,
                    init=start_from if isinstance(start_from, Path) else None)


def _initial_weights(source: Path, job: Job) -> Path | dict[str, torch.Tensor]:
    """A checkpoint (read by each rank for its regions), or whole tensors by parameter
    and buffer name from a state-dict file or a Hugging Face folder."""
    try:
        found: Path | None = checkpoint.latest(source)
    except checkpoint.CheckpointError:
        if source.is_dir() and not (source / ".metadata").exists() and \
                any(source.glob("step-*")):
            raise
        found = None
    if found is not None:
        checkpoint.check_fits(found, job.shapes, list(job.names))  # of this model, or named
        return found
    state = checkpoint.read_weights(source)
    whole: dict[str, torch.Tensor] = {}
    for name, saved_as in job.names.items():
        if name in state:
            whole.setdefault(saved_as, state[name])
    missing = sorted(set(job.shapes) - whole.keys())
    if missing:
        raise checkpoint.CheckpointError(f"{str(source)!r} has no weights for {missing[0]} "
                                         f"(and {len(missing) - 1} more)")
    for name, shape in job.shapes.items():
        if tuple(whole[name].shape) != shape:
            raise checkpoint.CheckpointError(
                f"{str(source)!r} holds {name} as {list(whole[name].shape)}, the model as "
                f"{list(shape)}")
    return whole
