"""Running a Program: one rank's training state, and all ranks as threads of one process."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._functorch import config as functorch_config

from chronotope.compile.compiled_regions import FUNCTION
from chronotope.compile.program import Program
from chronotope.errors import ChronotopeError
from chronotope.graph.batch import Batch
from chronotope.graph.capture import capture
from chronotope.graph.ir import Graph
from chronotope.graph.mask import Mask
from chronotope.graph.memory import PeakMemory
from chronotope.graph.rng import Stream
from chronotope.plan.replicas import same_but_batch
from chronotope.runtime.context import StepContext
from chronotope.runtime.optim import Optim, Rates
from chronotope.runtime.precision import (
    Precision,
    check_precision,
    plan_precision,
    step_error,
)
from chronotope.runtime.targets import Target, portable, resolve
from chronotope.runtime.transport import OrderedTransport, RankFailed, Replica
from chronotope.workload import Workload


@dataclass
class RankSpec:
    """Everything one rank needs to train: its code, its parameter regions, its data."""

    rank: int
    code: str
    params: dict[tuple[str, tuple], torch.Tensor]  # the regions this rank stores
    owned: list[tuple[str, tuple]]  # the regions it updates, each inside a stored one
    state: dict[str, torch.Tensor]
    batch: dict[str, torch.Tensor]
    # What each op calls, by reference where one exists: specs travel to other processes.
    targets: dict[str, Target | Callable[..., Any]] = field(default_factory=dict)
    groups: list[tuple[int, ...]] = field(default_factory=list)  # collectives' rank sets
    # Each owned region's share of the global gradient norm: 1 / how many ranks own it.
    norm_weights: dict[tuple[str, tuple], float] = field(default_factory=dict)
    world: int = 1
    # A torch.compile backend: the code's forward regions (``forward_<k>``) run through it.
    compile: str | None = None
    unit: int | None = None  # a scaled plan's devices per replica (``code`` is replica 0's)
    eval_code: str | None = None  # the plan's evaluation (``Plan.evaluation``), if asked for


def check_compile(backend: str | None) -> None:
    """Refuse a ``torch.compile`` backend this torch does not have, naming those it has."""
    if backend is not None and backend not in torch.compiler.list_backends(exclude_tags=()):
        raise ChronotopeError(f"torch.compile has no backend {backend!r}; choose from "
                              f"{', '.join(torch.compiler.list_backends())} (or aot_eager, "
                              "eager to check what the graphs capture)")


def rank_specs(program: Program, workload: Workload, compile: str | None = None,
               evaluation: Program | None = None, only: int | None = None,
               weights: bool = True) -> list[RankSpec]:
    """What each rank runs (``only``: just that global rank's, for a process that runs one
    rank); with ``compile`` (a ``torch.compile`` backend), each run of forward pieces
    between communications is a function the rank compiles with it. A scaled plan's
    replicas each run the unit's code on their rows of ``workload``'s batch.
    ``evaluation``: the compiled ``program.plan.evaluation()``, which each rank runs on
    the parameter regions it trains. Without ``weights``, each region is a meta tensor
    of its shape (a program saved to start from a checkpoint)."""
    check_compile(compile)
    if evaluation is not None and evaluation.stored != program.stored:
        raise ChronotopeError("the evaluation program stores other parameter regions than "
                              "the training program: compile it from program.plan.evaluation()")
    graph = program.plan.graph
    unit, replicas = program.ndevices, program.plan.replicas
    full = {n: p.detach() for n, p in workload.model.named_parameters()}
    state = {n: b.detach() for n, b in workload.model.named_buffers()}
    state.update(graph.constants)
    tensors = Batch.of(workload.inputs, workload.kwargs, workload.targets).tensors()
    batches = replica_batches(graph, tensors, replicas)
    if replicas > 1:
        same_but_batch(graph, capture(workload, registry=graph.registry, check_up_to=0,
                                      frontend=graph.frontend, name=graph.name), replicas)
    targets = portable({op.name: op.target for op in graph.ops if callable(op.target)})
    updated = [program.updated(rank) for rank in range(unit * replicas)]
    owners: dict[tuple[str, tuple], int] = defaultdict(int)
    for regions in updated:
        for key in regions:
            owners[key] += 1
    ranks = range(unit * replicas) if only is None else [only]
    codes = {rank % unit: program.code(rank % unit, regions=compile is not None)
             for rank in ranks}
    evals = {rank % unit: evaluation.code(rank % unit, regions=compile is not None)
             if evaluation else None for rank in ranks}
    groups = world_groups(program.groups, unit, replicas)
    return [
        RankSpec(
            g, codes[g % unit],
            {(name, region.index): _region(full[name], region.to_slices(), weights)
             for name, regions in program.stored[g % unit].items() for region in regions},
            updated[g], state, batches[g // unit], targets, groups,
            {key: 1 / owners[key] for key in updated[g]},
            unit * replicas, compile, unit if replicas > 1 else None, evals[g % unit],
        )
        for g in ranks
    ]


def _region(whole: torch.Tensor, slices: tuple[slice, ...], weights: bool) -> torch.Tensor:
    part = whole[slices]
    return part.clone() if weights else torch.empty(part.shape, dtype=part.dtype,
                                                    device="meta")


def replica_batches(graph: Graph, tensors: list[torch.Tensor], replicas: int
                    ) -> list[dict[str, torch.Tensor]]:
    """Each replica's rows of the batch (all of it for one), as the graph's inputs by name:
    a scaled plan's graph is captured on one replica's share of the batch."""
    batch = {t.name: v for t, v in zip(graph.inputs, tensors)}
    if replicas == 1:
        return [batch]
    for t, v in zip(graph.inputs, tensors):
        if v.dim() == 0 or v.shape[0] != replicas * t.shape[0]:
            raise ChronotopeError(
                f"input {t.name} has shape {tuple(v.shape)}, but a plan scaled to {replicas} "
                f"replicas of a graph captured with {t.shape[0] if t.shape else 1} rows needs "
                f"{replicas} x that many; pass the whole batch, {replicas} replicas' rows")
    return [replica_rows(batch, replicas, r) for r in range(replicas)]


def replica_rows(batch: Mapping[str, torch.Tensor], replicas: int, replica: int
                 ) -> dict[str, torch.Tensor]:
    """The rows of a whole batch that replica ``replica`` of ``replicas`` trains on."""
    return {n: t.chunk(replicas)[replica] for n, t in batch.items()}


def world_groups(groups: list[tuple[int, ...]], unit: int, replicas: int
                 ) -> list[tuple[int, ...]]:
    """The process groups of all replicas: each replica's copy of a unit's group, and the
    groups of a device's replicas (the same for all), in one order for every rank."""
    out = [g for g in groups if max(g) >= unit]
    out += [tuple(x + r * unit for x in g) for r in range(replicas) for g in groups
            if max(g) < unit]
    return out


class Rank:
    """One rank: its generated step, its parameter regions and their optimizer.

    With a ``precision`` (``runtime/precision.py``) the step computes under its autocast
    while the regions, their gradients and the optimizer's state stay fp32; under fp16 the
    loss is scaled and a step with an inf or NaN gradient on any rank is skipped on all.
    """

    def __init__(self, spec: RankSpec, transport: Any, optim: Optim,
                 device: torch.device | str = "cpu", seed: int = 0,
                 precision: Precision | None = None) -> None:
        self.rank = spec.rank
        self.device = torch.device(device)
        # A replica of a scaled plan runs replica 0's code: it names ranks as replica 0 does.
        self.unit_rank = spec.rank % spec.unit if spec.unit else spec.rank
        self.transport = Replica(transport, spec.rank // spec.unit, spec.unit, spec.world) \
            if spec.unit else transport
        self.replica = (spec.rank // spec.unit, spec.world // spec.unit, spec.unit) \
            if spec.unit else None
        self.precision = None if precision is None or precision.plain else precision
        self.scaler = self.precision.scaler() if self.precision else None  # fp16 only
        self.code = spec.code
        self.filename = f"<chronotope rank {spec.rank}>"
        scope = _module(spec.code, self.filename, spec.compile)
        self.step_fn = scope["step"]
        self.refresh_fn = scope.get("refresh")
        self.eval_fn = _module(spec.eval_code, f"<chronotope rank {spec.rank} evaluation>",
                               spec.compile)["step"] if spec.eval_code else None
        self.stored = {k: v.to(self.device) for k, v in spec.params.items()}
        # What the optimizer updates is a view of what the pieces read: no second copy.
        self.params = {k: nn.Parameter(self._view(*k)) for k in spec.owned}
        self.state = {n: t.to(self.device) for n, t in spec.state.items()}
        self.batch = {n: t.to(self.device) for n, t in spec.batch.items()}
        self.targets = resolve(spec.targets)
        self.norm_weights = spec.norm_weights
        self.world = tuple(range(spec.world))
        self.clip = optim.clip
        # A rank may hold no weights at all (it only runs activations).
        self.optimizer = optim.build(list(self.params.values())) if self.params else None
        self.peak_memory: int | None = None  # measured, when ``step(measure=True)``
        self.ticks: list[float] | None = None  # a list: code with ticks appends to it
        self.steps = 0  # forward passes run: each draws its own random numbers
        self.seed = seed

    def _view(self, name: str, index: tuple) -> torch.Tensor:
        region = Mask(index)
        for (stored_name, stored_index), t in self.stored.items():
            within = Mask(stored_index)
            if stored_name == name and within.contains(region):
                return t[region.local_slices(within)]
        raise ValueError(f"rank {self.rank} updates {name}{list(index)} but does not store it")

    def step(self, measure: bool = False) -> list[float]:
        """One training step on the rank's batch; with ``measure``, also the peak bytes of
        what the step made (``PeakMemory``), kept as the largest seen in ``peak_memory``."""
        self.zero_grad()
        losses = self.forward_backward(measure)
        self.update()
        return losses

    def zero_grad(self) -> None:
        if self.optimizer:
            self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, measure: bool = False) -> list[float]:
        """The generated step on ``self.batch``: its gradients add to the owned regions'."""
        rt = self._context(self.state, self.ticks, Stream(self.seed, self.steps),
                           self.scaler.scale if self.scaler else 1.0)
        self.steps += 1
        if self.precision is None:
            self._run(rt, measure)
        else:
            try:
                with self.precision.autocast(self.device.type):
                    self._run(rt, measure)
            except Exception as e:
                error = step_error(e, self.code, self.filename, self.rank, self.precision,
                                   self.device.type)
                if error is None:
                    raise
                raise error from e
        self.transport.flush()
        return rt.losses

    def evaluate(self) -> list[float]:
        """The plan's evaluation on ``self.batch``: its losses (where the loss is), with
        no gradient, dropout off, and the buffers and random stream left as they were."""
        if self.eval_fn is None:
            raise ChronotopeError(f"rank {self.rank} has no evaluation program: make its "
                                  "specs with rank_specs(..., evaluation=...)")
        rt = self._context(dict(self.state), stream=Stream(self.seed, self.steps,
                                                           training=False))
        cast = self.precision.autocast(self.device.type) if self.precision else \
            contextlib.nullcontext()
        with torch.no_grad(), cast:
            self.eval_fn(rt)
        self.transport.flush()
        return rt.losses

    def _context(self, state: dict, ticks: list[float] | None = None,
                 stream: Stream | None = None, loss_scale: float = 1.0,
                 precision: bool = True) -> StepContext:
        """What one run of a generated program reads and writes on this rank."""
        return StepContext(self.unit_rank, self.device, self.stored, self.params, state,
                           self.batch, self.transport, self.targets, ticks, stream,
                           self.precision if precision else None, loss_scale, self.replica)

    def _run(self, rt: StepContext, measure: bool) -> None:
        if measure:
            with torch.enable_grad(), PeakMemory() as watch:
                self.step_fn(rt)
            self.peak_memory = max(self.peak_memory or 0, watch.peak)
        else:
            with torch.enable_grad():
                self.step_fn(rt)

    def update(self, grad_scale: float = 1.0, norm: float | None = None) -> bool:
        """The optimizer step on the gradients gathered so far, times ``grad_scale`` (the
        mean over accumulated batches); then every stored copy of a region is refreshed.
        ``norm``: their global norm (times ``grad_scale``) if known, for clipping.
        False when fp16's loss scaling skipped the step (an inf or NaN on some rank)."""
        if self.scaler is not None:
            if not self._unscale(grad_scale):
                return False
        elif grad_scale != 1.0:
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        if self.clip is not None:
            self.clip_gradients(self.clip, norm)
        if self.optimizer:
            self.optimizer.step()
        if self.refresh_fn:
            rt = self._context(self.state, precision=False)
            with torch.no_grad():
                self.refresh_fn(rt)
            self.transport.flush()
        return True

    def _unscale(self, grad_scale: float) -> bool:
        """Divide the owned gradients by the loss scale (times ``grad_scale``); whether
        every rank's are finite (one all-reduce of the flag over all ranks, so all skip
        together), and the next scale."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        found = self.scaler.unscale_(grads, grad_scale, self.device)
        if len(self.world) > 1:
            found = self.transport.all_reduce(found, self.world, self.unit_rank)
        return self.scaler.update(bool(found.item() > 0))

    def grad_norm(self) -> float:
        """The global norm of the gradients: each rank sums the squares of the regions it
        owns (a region owned by k ranks counts 1/k on each); one all-reduce sums those.
        Each region's norm is taken in its own dtype, as ``clip_grad_norm_`` does: no copy."""
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for key, p in self.params.items():
            if p.grad is not None:
                local += self.norm_weights[key] * torch.linalg.vector_norm(p.grad).double() ** 2
        total = self.transport.all_reduce(local, self.world, self.unit_rank) \
            if len(self.world) > 1 else local
        return float(total.sqrt())

    def clip_gradients(self, max_norm: float, norm: float | None = None) -> float:
        """Scale every rank's gradients so their global norm (``norm``, measured if not
        given) is at most ``max_norm``."""
        norm = self.grad_norm() if norm is None else norm
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in self.params.values():
                if p.grad is not None:
                    p.grad = p.grad * coef
        return norm

    def regions(self) -> dict[tuple[str, tuple], torch.Tensor]:
        """The regions this rank stores (the ones it updates are views into them)."""
        return {k: t.detach().cpu() for k, t in self.stored.items()}


def _module(code: str, filename: str, backend: str | None) -> dict[str, Any]:
    """Generated code's names; with a ``torch.compile`` backend, its forward regions
    compiled with it."""
    scope: dict[str, Any] = {}
    exec(compile(code, filename, "exec"), scope)
    if backend is not None:
        # A region that returns views of one intermediate (the logits cut for a token loss)
        # comes back from a warm AOTAutograd cache with garbage view sizes (torch 2.13):
        # compile each afresh.
        functorch_config.enable_autograd_cache = False
        for name in [n for n in scope if n.startswith(FUNCTION)]:
            scope[name] = torch.compile(scope[name], backend=backend)
    return scope


@dataclass
class RunResult:
    losses: list[float]  # per step, as rank 0 assembled them
    params: dict[str, torch.Tensor]  # final parameters, reassembled from the ranks' regions
    step_times: list[float] = field(default_factory=list)  # rank 0's seconds per step
    peak_memory: list[int] = field(default_factory=list)  # per rank, bytes (measure_memory)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # final buffers, by name
    # calls that drew from torch's generator, which no plan replays (the reference run's)
    unreplayed: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)  # per step, from ct.train
    # under torchrun: the regions this rank stores (``ct.to_dtensors`` wraps them)
    regions: dict[tuple[str, tuple], torch.Tensor] = field(default_factory=dict)


def run_in_threads(program: Program, workload: Workload, steps: int,
                   optim: Optim | None = None, timeout: float = 60.0,
                   measure_memory: bool = False,
                   precision: Precision | None = None) -> RunResult:
    """Every rank as a thread of this process: the same generated code, messages in memory,
    matched by order as NCCL matches them (``OrderedTransport``). With ``measure_memory``,
    each rank's peak of what its steps made (``PeakMemory``); with ``precision``, mixed
    precision (default: the plan's dtype; refused first if an op cannot run in it)."""
    precision = precision or plan_precision(program.plan)
    check_precision(program.plan.graph, precision, "cpu")
    optim = optim or Optim()
    optim.check_plan(program)
    transport = OrderedTransport(timeout)
    ranks = [Rank(spec, transport, optim, precision=precision)
             for spec in rank_specs(program, workload)]
    losses: list[float] = []
    errors: dict[int, BaseException] = {}

    def work(rank: Rank) -> None:
        try:
            rates = Rates(optim, steps)
            for _ in range(steps):
                rates.apply(rank.optimizer)
                out = rank.step(measure_memory)
                rates.advance()
                if rank.rank == 0:
                    losses.extend(out)
        except BaseException as e:  # noqa: BLE001  (re-raised below, once every thread ended)
            errors[rank.rank] = e
            transport.fail(rank.rank, e)

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:  # the root cause, not the ranks that timed out waiting on it
        cause = next((e for _, e in sorted(errors.items()) if not isinstance(e, RankFailed)),
                     errors[min(errors)])
        raise cause
    return RunResult(losses, gather_params([r.regions() for r in ranks], workload),
                     peak_memory=[r.peak_memory or 0 for r in ranks] if measure_memory else [],
                     buffers=model_buffers(ranks[0].state, workload))


def model_buffers(state: Mapping[str, torch.Tensor], workload: Workload
                  ) -> dict[str, torch.Tensor]:
    """The model's buffers in a rank's state after training (every rank keeps them whole)."""
    return {n: state[n].detach().cpu() for n, _ in workload.model.named_buffers() if n in state}


def gather_params(regions: list[dict[tuple[str, tuple], torch.Tensor]],
                  workload: Workload) -> dict[str, torch.Tensor]:
    """Whole parameters from the regions the ranks hold (replicas agree; any one will do)."""
    out = {n: torch.full_like(p, float("nan")) for n, p in workload.model.named_parameters()}
    for held in regions:
        for (name, index), p in held.items():
            out[name][Mask(index).to_slices()] = p
    return out
