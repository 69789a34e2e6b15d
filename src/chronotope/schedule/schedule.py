"""``ct.schedule``: a plan written module by module, on a model nobody edits (Slapo-style).

    sch = ct.schedule(model, example_inputs, devices=2)
    attn = sch["h.0.attn"]
    attn["c_attn"].shard(["weight", "bias"], axis=0)     # column parallel
    attn["c_attn"].sync(mode="bwd_post", op="all_reduce")
    attn["c_proj"].shard("weight", axis=1)               # row parallel
    attn["c_proj"].sync(mode="fwd_post", op="all_reduce")
    plan = sch.plan()                                    # op_trans / op_assign / op_order

A schedule mirrors the module tree: ``sch["a.b"]`` is the sub-schedule of that
module, and each primitive records one step, checked as it is applied where the
step alone can be judged (a parameter that does not exist, an axis out of range, a
sync before any shard, a pipeline cut after a module that does not run as one
stretch). ``plan()`` lowers every step at once (``schedule.lower``), with the
checks that need the whole schedule (a sharded output that meets an op which
cannot take it with no sync between them). Everything after the plan (check,
compile, runtime, simulator, plan files) is shared with every other plan.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chronotope.errors import ChronotopeError, ScheduleError
from chronotope.graph import rng
from chronotope.graph.capture import capture
from chronotope.graph.convert import is_random
from chronotope.graph.ir import Graph, Op, PTensor, Source
from chronotope.graph.rewrite import reads, splice
from chronotope.plan import Plan
from chronotope.plan.plan import Fusion
from chronotope.policies.pipeline import MULTI_STAGE, SCHEDULES
from chronotope.schedule.lower import (
    SYNC_MODES,
    SYNC_OPS,
    ShardStep,
    Steps,
    Sync,
    inside,
    lower,
    module_of,
    ref,
    stages,
)
from chronotope.workload import Workload

# ``@schedule_primitive`` functions, by name: ``sch[...].name(...)`` calls them
PRIMITIVES: dict[str, Callable[..., Any]] = {}


@dataclass(frozen=True)
class Subgraph:
    """Ops that ``find`` matched, in program order; ``checkpoint``, ``swap``, ``fuse`` and
    ``replace`` take it."""

    ops: tuple[Op, ...]

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def inputs(self) -> list[PTensor]:
        """What its ops read from outside it, in order: what ``replace(fn, subgraph)``
        passes ``fn``."""
        return reads(self.ops)

    def __repr__(self) -> str:
        return f"Subgraph({', '.join(op.name for op in self.ops)})"


class _State:
    """What every sub-schedule of one schedule shares."""

    def __init__(self, workload: Workload, graph: Graph, devices: int,
                 knobs: dict[str, Any]) -> None:
        self.original = workload  # the model as the user wrote it: verify's reference
        self.workload, self.graph = workload, graph
        self.steps = Steps(devices)
        self.log: list[str] = []
        self.knobs = knobs  # the values chosen for this run (the tuner's point)
        self.knob_calls: list[tuple[str, list[Any], Any]] = []  # (name, choices, value)
        self.rewrites: list[str] = []  # the replace(fn, subgraph) / decompose steps so far
        self.index()

    def index(self) -> None:
        """The model's modules, and every name a parameter has (tied weights have several)
        -> the graph's name for it, with its size."""
        model = self.workload.model
        self.modules = dict(model.named_modules())
        seen: dict[int, str] = {}
        self.params: dict[str, str] = {}
        self.sizes: dict[str, tuple[int, ...]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.params[name] = seen.setdefault(id(p), name)
            self.sizes[name] = tuple(p.shape)

    def ops(self, ops: Iterable[Op], what: str) -> list[Op]:
        """``ops`` (found earlier) as the graph now has them; refused where a rewrite
        since replaced one."""
        now = {op.name: op for op in self.graph.ops}
        found = []
        for op in ops:
            current = now.get(op.name)
            if current is None or current.kind != op.kind or module_of(current) != module_of(op):
                raise ScheduleError(f"{what}: op {op.name} ({op.kind}) is no longer in the "
                                    f"graph ({'; '.join(self.rewrites)} changed it); find "
                                    "the subgraph again after the rewrite")
            found.append(current)
        return found

    def rewritten(self, graph: Graph, old: set[str], step: str) -> None:
        """Take the graph a rewrite made; the ops it made inherit what the schedule had
        decided for the ops they replace (checkpointed, swapped, fused)."""
        new = {op.name for op in graph.ops} - {op.name for op in self.graph.ops}
        steps = self.steps
        for chosen in (steps.recompute, steps.swap):
            if chosen & old:
                chosen -= old
                chosen |= new
        fusions = {steps.fused[n] for n in old if n in steps.fused}
        for name in old:
            steps.fused.pop(name, None)
        if fusions:
            steps.fused.update(dict.fromkeys(new, min(fusions, key=lambda f: f.group)))
        self.graph = graph
        self.rewrites.append(step)


class Schedule:
    """The schedule of one module (the root: the whole model); see the module docstring."""

    def __init__(self, state: _State, path: str = "") -> None:
        self._state, self.path = state, path

    # ---- the module tree ----------------------------------------------------------------

    def __getitem__(self, name: str) -> Schedule:
        full = _join(self.path, name)
        if full not in self._state.modules:
            near = difflib.get_close_matches(full, list(self._state.modules), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else \
                f"; its modules: {', '.join(self.modules()[:8]) or 'none'}"
            raise ScheduleError(f"{ref(self.path)} has no module {name!r}{hint}")
        return Schedule(self._state, full)

    @property
    def module(self) -> nn.Module:
        return self._state.modules[self.path]

    @property
    def graph(self) -> Graph:
        return self._state.graph

    @property
    def devices(self) -> int:
        return self._state.steps.devices

    @property
    def workload(self) -> Workload:
        """The model the schedule's plan runs: the user's, or a copy with the modules
        ``replace`` swapped in."""
        return self._state.workload

    def modules(self) -> list[str]:
        """The paths of this module's descendants, relative to it, in definition order."""
        cut = len(self.path) + 1 if self.path else 0
        return [m[cut:] for m in self._state.modules if m != self.path and inside(m, self.path)]

    def ops(self) -> list[Op]:
        """The captured ops this module runs, in program order."""
        return [op for op in self._state.graph.ops if inside(module_of(op), self.path)]

    @property
    def steps(self) -> list[str]:
        """Every primitive applied so far, as it was called."""
        return list(self._state.log)

    def __repr__(self) -> str:
        return f"Schedule({self.path or 'root'}, {len(self.ops())} ops)"

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name in PRIMITIVES:
            primitive = PRIMITIVES[name]

            def apply(*args: Any, **kwargs: Any) -> Any:
                return primitive(self, *args, **kwargs)
            return apply
        raise AttributeError(f"a schedule has no primitive {name!r}; built in: shard, sync, "
                             "checkpoint, swap, find, cut_pipeline_stage, micro_batches, place, "
                             f"replicate; registered: {', '.join(PRIMITIVES) or 'none'}")

    def _record(self, call: str) -> None:
        self._state.log.append(f"{ref(self.path)}.{call}")

    # ---- tensor parallelism -------------------------------------------------------------

    def shard(self, params: str | Sequence[str], axis: int) -> Schedule:
        """Cut parameters of this module along ``axis`` over each stage's devices, and the
        ops of this module that read them with it. A weight is (out, in): axis 0 is column
        parallel (the outputs come out cut), axis 1 row parallel (partial sums)."""
        if self.devices < 2:
            raise ScheduleError(f"{ref(self.path)}.shard: a shard splits over devices, and "
                                "this schedule has 1; make it with ct.schedule(..., devices=N)")
        names = [params] if isinstance(params, str) else list(params)
        for name in names:
            full = _join(self.path, name)
            if full not in self._state.params:
                own = [n[len(self.path) + 1:] if self.path else n for n in self._state.params
                       if inside(n.rpartition(".")[0], self.path)]
                raise ScheduleError(f"{ref(self.path)}.shard({name!r}): no such parameter; "
                                    f"its parameters: {', '.join(own[:8]) or 'none'}")
            rank = len(self._state.sizes[full])
            if not -rank <= axis < rank:
                raise ScheduleError(f"{ref(self.path)}.shard({name!r}, axis={axis}): {full} "
                                    f"has {rank} axes")
            step = ShardStep(self.path, self._state.params[full], name, axis % rank)
            clash = [s for s in self._state.steps.shards
                     if (s.module, s.param) == (step.module, step.param) and s.axis != step.axis]
            if clash:
                raise ScheduleError(f"{step}: {clash[0]} already cuts it along another axis")
            if step not in self._state.steps.shards:
                self._state.steps.shards.append(step)
        self._record(f"shard({params!r}, axis={axis})")
        return self

    def sync(self, mode: str = "fwd_post", op: str = "all_reduce") -> Schedule:
        """Where a sharded stretch ends: ``fwd_post``, what leaves this module is made whole
        (``all_reduce`` of partial sums, ``all_gather`` of a cut) or cut along the sequence
        (``reduce_scatter``); ``fwd_pre``, what enters it; ``bwd_post``, its input gradient
        is summed. The compiler derives the collective; the sync is checked against it."""
        sync = Sync(self.path, mode, op)
        if mode not in SYNC_MODES or op not in SYNC_OPS:
            raise ScheduleError(f"{sync}: mode is one of {', '.join(SYNC_MODES)} and op one of "
                                f"{', '.join(SYNC_OPS)}")
        steps = self._state.steps
        sharded = any(inside(s.module, self.path) or
                      inside(_join(s.module, s.written).rpartition(".")[0], self.path)
                      for s in steps.shards)
        sequence = mode == "fwd_pre" and op == "all_gather" and any(
            s.op == "reduce_scatter" for s in steps.syncs)
        if not sharded and not sequence:
            raise ScheduleError(f"{sync}: nothing in {self.path or 'the model'} is sharded; "
                                "shard its parameters first (.shard(param, axis))")
        twin = [s for s in steps.syncs if (s.module, s.mode) == (self.path, mode)]
        if twin and twin[0] != sync:
            raise ScheduleError(f"{sync}: {twin[0]} is already there")
        if not twin:
            steps.syncs.append(sync)
        self._record(f"sync(mode={mode!r}, op={op!r})")
        return self

    # ---- activations --------------------------------------------------------------------

    def checkpoint(self, subgraph: Subgraph | Iterable[Subgraph] | None = None) -> Schedule:
        """Keep none of this module's activations (or of ``subgraph``'s ops): the backward
        makes them again (activation checkpointing)."""
        return self._keep_off(subgraph, "checkpoint")

    def swap(self, subgraph: Subgraph | Iterable[Subgraph] | None = None) -> Schedule:
        """Keep what this module's ops (or ``subgraph``'s) save for their backward in CPU
        memory until the backward needs it."""
        return self._keep_off(subgraph, "swap")

    def _keep_off(self, subgraph: Subgraph | Iterable[Subgraph] | None, what: str) -> Schedule:
        """Mark the ops ``checkpoint`` or ``swap`` names; an op is one or the other."""
        steps = self._state.steps
        mine, other, done = (steps.recompute, steps.swap, "swapped") if what == "checkpoint" \
            else (steps.swap, steps.recompute, "checkpointed")
        names = self._chosen(subgraph, what)
        if names & steps.fused.keys():
            raise ScheduleError(f"{ref(self.path)}.{what}: {sorted(names & steps.fused.keys())[0]}"
                                " is fused; a fused op runs once, inside its compiled function")
        clash = names & other
        if clash:
            raise ScheduleError(f"{ref(self.path)}.{what}: {sorted(clash)[0]} is {done} "
                                "already; an op's activations are either made again or swapped")
        mine |= names
        self._record(f"{what}({_arg(subgraph)})")
        return self

    def _chosen(self, subgraph: Subgraph | Iterable[Subgraph] | None, what: str) -> set[str]:
        return {op.name for op in self._subgraph_ops(subgraph, what)}

    def _subgraph_ops(self, subgraph: Subgraph | Iterable[Subgraph] | None, what: str
                      ) -> list[Op]:
        """The ops of ``subgraph`` (of this module when None), in program order."""
        if subgraph is None:
            ops = self.ops()
        else:
            parts = [subgraph] if isinstance(subgraph, Subgraph) else list(subgraph)
            ops = self._state.ops([op for part in parts for op in part],
                                  f"{ref(self.path)}.{what}")
        if not ops:
            raise ScheduleError(f"{ref(self.path)}.{what}: no op to {what} "
                                f"({self.path or 'the model'} runs none, or the subgraph is "
                                "empty)")
        order = {op: i for i, op in enumerate(self._state.graph.ops)}
        return sorted(set(ops), key=order.__getitem__)

    def find(self, pattern: str | Sequence[str] | Callable[[Op], bool]) -> list[Subgraph]:
        """This module's ops that match: a regex on an op's kind or name (each op its own
        subgraph), a list of such regexes (chains, each op reading the one before), or a
        function of an op."""
        ops = self.ops()
        if callable(pattern):
            return [Subgraph((op,)) for op in ops if pattern(op)]
        kinds = [pattern] if isinstance(pattern, str) else list(pattern)
        if not kinds:
            raise ScheduleError(f"{ref(self.path)}.find: the pattern is empty")
        try:
            regexes = [re.compile(k) for k in kinds]
        except re.error as e:
            raise ScheduleError(f"{ref(self.path)}.find({pattern!r}): {e}") from e

        def fits(op: Op, k: int) -> bool:
            return bool(regexes[k].fullmatch(op.kind) or regexes[k].fullmatch(op.name))

        readers = self._state.graph.consumers()
        mine = set(ops)
        chains = [[op] for op in ops if fits(op, 0)]
        for k in range(1, len(regexes)):
            chains = [chain + [r] for chain in chains for t in chain[-1].outputs
                      for r in readers.get(t, ()) if r in mine and fits(r, k)]
        return [Subgraph(tuple(chain)) for chain in chains]

    # ---- rewriting and fusing -----------------------------------------------------------

    def fuse(self, subgraph: Subgraph | Iterable[Subgraph] | None = None,
             compiler: str = "torch.compile") -> Schedule:
        """Run this module's ops (or ``subgraph``'s) as one function that ``torch.compile``
        compiles in the generated code; ``compiler``: "torch.compile" (its default backend)
        or one of its backends by name ("inductor", "aot_eager"...). On each rank, the
        fused pieces that run back to back with no communication between them are one
        function."""
        from chronotope.runtime.local import check_compile

        backend = "inductor" if compiler == "torch.compile" else compiler
        try:
            check_compile(backend)
        except ChronotopeError as e:
            raise ScheduleError(f"{ref(self.path)}.fuse(compiler={compiler!r}): {e}") from e
        ops = self._subgraph_ops(subgraph, "fuse")
        steps = self._state.steps
        for op in ops:
            why = ("checkpointed (a fused op runs once, inside its function)"
                   if op.name in steps.recompute else
                   "swapped (a fused op keeps what it saves inside its function)"
                   if op.name in steps.swap else
                   f"fused already, as {steps.fused[op.name].group}"
                   if op.name in steps.fused else
                   "random (its draws stay outside compiled code)"
                   if is_random(op) or rng.drawn(op.target) else None)
            if why:
                raise ScheduleError(f"{ref(self.path)}.fuse: op {op.name} ({op.kind}) is "
                                    f"{why}; fuse the ops around it")
        fusion = Fusion(f"fusion{len(set(steps.fused.values()))}", backend)
        steps.fused.update(dict.fromkeys((op.name for op in ops), fusion))
        self._record(f"fuse({_arg(subgraph)}{'' if compiler == 'torch.compile' else ', '}"
                     f"{'' if compiler == 'torch.compile' else f'compiler={compiler!r}'})")
        return self

    def replace(self, new: nn.Module | Callable[..., Any],
                subgraph: Subgraph | Iterable[Subgraph] | None = None) -> Schedule:
        """Without ``subgraph``: this module becomes the module ``new``, in a copy of the
        model (the user's stays as it is: ``verify`` compares with it), which is captured
        again; replace modules before scheduling them. With ``subgraph``: its ops become
        what ``new`` computes; it takes the subgraph's inputs, in the order its ops first
        read them, and returns what of its results is read after it, alike in shape and
        dtype (``graph.rewrite``)."""
        if subgraph is not None:
            step = f"replace({_label(new)}, {subgraph!r})"
            self._rewrite(self._subgraph_ops(subgraph, "replace"), new, step)
            self._record(step)
            return self
        if not isinstance(new, nn.Module):
            raise ScheduleError(f"{ref(self.path)}.replace({_label(new)}): a function replaces "
                                "the subgraph it is given (replace(fn, subgraph)); a module "
                                "alone replaces this module")
        self._replace_module(new)
        self._record(f"replace({_label(new)})")
        return self

    def _replace_module(self, new: nn.Module) -> None:
        state, what = self._state, f"{ref(self.path)}.replace({_label(new)})"
        if not self.path:
            raise ScheduleError(f"{what}: replace a module of the model "
                                "(sch['h.0.mlp'].replace(...)); for a new model, schedule it")
        if state.rewrites:
            raise ScheduleError(f"{what}: it captures the model again, which would undo "
                                f"{state.rewrites[0]}; replace modules first")
        steps = state.steps
        if steps.recompute or steps.swap or steps.fused:
            raise ScheduleError(f"{what}: it captures the model again, and the ops that "
                                "checkpoint, swap or fuse chose change names; replace modules "
                                "first")
        scheduled = [str(s) for s in (*steps.shards, *steps.syncs) if inside(s.module, self.path)]
        scheduled += [f"{ref(m)}.cut_pipeline_stage()" for m in steps.cuts if inside(m, self.path)]
        if scheduled:
            raise ScheduleError(f"{what}: {scheduled[0]} schedules the module it replaces; "
                                "replace it first")
        model = state.workload.model if state.workload is not state.original else \
            copy.deepcopy(state.original.model)
        parent, _, name = self.path.rpartition(".")
        setattr(model.get_submodule(parent), name, new)
        workload = dataclasses.replace(state.workload, model=model)
        try:
            graph = capture(workload)
        except ChronotopeError as e:
            raise ScheduleError(f"{what}: the model no longer captures: {e}") from e
        state.workload, state.graph = workload, graph
        state.index()

    def decompose(self) -> Schedule:
        """Split the bias out of this module's projections that add one (``linear(x, w, b)``,
        ``addmm(b, x, w)``): the product, then an add of the bias, which can then be fused
        with what follows it (``fuse``) or wait for a sync (a row-parallel projection's
        bias is added once its partial sums are whole)."""
        biased = [op for op in self.ops() if _bias_split(op) is not None]
        if not biased:
            raise ScheduleError(f"{ref(self.path)}.decompose(): {self.path or 'the model'} "
                                "has no linear or addmm op that adds a bias")
        for op in biased:
            self._rewrite([op], _bias_split(op), "decompose()", op.source)
        self._record("decompose()")
        return self

    def _rewrite(self, ops: list[Op], fn: Callable[..., Any], step: str,
                 source: Source | None = None) -> None:
        state = self._state
        try:
            graph = splice(state.graph, ops, fn, _common(module_of(op) for op in ops), source)
        except ChronotopeError as e:
            raise ScheduleError(f"{ref(self.path)}.{step}: {e}") from e
        state.rewritten(graph, {op.name for op in ops}, f"{ref(self.path)}.{step}")

    # ---- pipeline, placement, data parallel ---------------------------------------------

    def cut_pipeline_stage(self) -> Schedule:
        """End a pipeline stage after this module: what follows runs on the next stage's
        devices (``micro_batches`` chooses how many micro-batches and their order)."""
        if not self.path:
            raise ScheduleError("sch.cut_pipeline_stage(): cut after a module of the model, "
                                "e.g. sch['layers.3'].cut_pipeline_stage()")
        cuts = self._state.steps.cuts
        if self.path not in cuts:
            stages(self._state.graph, cuts + [self.path])  # refuses a cut it cannot make
            cuts.append(self.path)
        self._record("cut_pipeline_stage()")
        return self

    pipeline_split = cut_pipeline_stage  # Slapo's name for the same cut

    def micro_batches(self, n: int, schedule: str = "1f1b") -> Schedule:
        """Run each data-parallel group's batch as ``n`` micro-batches (their gradients
        summed); with pipeline stages, in the order of ``schedule`` (gpipe, 1f1b, zb1...)."""
        self._root("micro_batches")
        if n < 1:
            raise ScheduleError(f"sch.micro_batches({n}): at least 1")
        if schedule not in SCHEDULES or schedule in MULTI_STAGE:
            single = [s for s in SCHEDULES if s not in MULTI_STAGE]
            raise ScheduleError(f"sch.micro_batches({n}, schedule={schedule!r}): choose one "
                                f"of {', '.join(single)}")
        self._divides(self._state.steps.replicas * n, f"micro_batches({n})")
        self._state.steps.micro, self._state.steps.schedule = n, schedule
        self._record(f"micro_batches({n}, schedule={schedule!r})")
        return self

    def place(self, devices: int | Sequence[int]) -> Schedule:
        """Run this module's ops on these devices of each data-parallel group (its shards
        split over them); by default a module runs on all of them."""
        where = (devices,) if isinstance(devices, int) else tuple(devices)
        steps = self._state.steps
        if not where or len(set(where)) < len(where) or \
                any(not 0 <= d < steps.devices for d in where):
            raise ScheduleError(f"{ref(self.path)}.place({list(where)}): distinct devices "
                                f"in 0..{steps.devices - 1}")
        steps.placed[self.path] = where
        self._record(f"place({list(where)})")
        return self

    def replicate(self, n: int | None = None) -> Schedule:
        """Run the model on ``n`` data-parallel groups of devices (default: every device its
        own), each on its share of the batch; gradients are summed over the groups."""
        self._root("replicate")
        steps = self._state.steps
        n = steps.devices if n is None else n
        if n < 1 or steps.devices % n:
            raise ScheduleError(f"sch.replicate({n}): the groups must divide the "
                                f"{steps.devices} devices")
        self._divides(n * steps.micro, f"replicate({n})")
        steps.replicas = n
        self._record(f"replicate({n})")
        return self

    def _root(self, what: str) -> None:
        if self.path:
            raise ScheduleError(f"{ref(self.path)}.{what}: it applies to the whole model; "
                                f"call sch.{what}(...) on the root schedule")

    def _divides(self, parts: int, what: str) -> None:
        batch = self._state.graph.batch_size
        if parts > 1 and batch % parts:
            raise ScheduleError(f"sch.{what}: the example batch of {batch} samples does not "
                                f"split into {parts} parts (data-parallel groups x "
                                "micro-batches)")

    # ---- tuning -------------------------------------------------------------------------

    def knob(self, name: str, choices: Sequence[Any] | Callable[[dict[str, Any]], Sequence[Any]]
             ) -> Any:
        """A tunable value of the schedule: one of ``choices`` (or of what ``choices(values)``
        returns, for a range that depends on the knobs before it). ``ct.tune`` runs the
        schedule once per point; otherwise it is the value ``ct.schedule(knobs=...)`` (or
        ``--knob name=value``) gave, or the first choice."""
        state = self._state
        if any(n == name for n, _, _ in state.knob_calls):
            raise ScheduleError(f"sch.knob({name!r}): declared twice in one schedule")
        so_far = {n: v for n, _, v in state.knob_calls}
        options = list(choices(so_far) if callable(choices) else choices)
        if not options:
            raise ScheduleError(f"sch.knob({name!r}): no choices"
                                + (f" for {so_far}" if so_far else ""))
        value = state.knobs.get(name, options[0])
        if value not in options:
            raise ScheduleError(f"sch.knob({name!r}) = {value!r}: choose one of "
                                f"{', '.join(map(repr, options))}")
        state.knob_calls.append((name, options, value))
        return value

    # ---- the result ---------------------------------------------------------------------

    def plan(self) -> Plan:
        """The plan every step so far lowers to (``schedule.lower``)."""
        return lower(self._state.graph, self._state.steps)

    def verify(self, steps: int = 2, optim: Any = None, backend: str | None = None,
               timeout: float = 60.0) -> Verification:
        """Train with the schedule's plan and, beside it, the model as written on one
        device (before any ``replace``); report both runs' losses and how far the
        parameters (moved by the gradients) end apart. Ranks run as threads, or with
        ``backend`` ("gloo", "nccl") as processes."""
        from chronotope.compile import compile
        from chronotope.runtime.launch import run_processes
        from chronotope.runtime.local import run_in_threads
        from chronotope.runtime.optim import Optim
        from chronotope.runtime.reference import compare, train_reference

        optim = optim or Optim()
        program = compile(self.plan())
        workload, original = self._state.workload, self._state.original
        ours, theirs = dict(workload.model.named_parameters()), \
            dict(original.model.named_parameters())
        differ = sorted(ours.keys() ^ theirs.keys()) or sorted(
            n for n in ours if ours[n].shape != theirs[n].shape)
        if differ:
            raise ScheduleError(f"sch.verify(): the replaced modules' parameters are not the "
                                f"model's ({differ[0]} is in one and not the other, or "
                                "shaped otherwise), and verify compares them by name; give "
                                "the new module the names and shapes of the old")
        if backend is None:
            result = run_in_threads(program, workload, steps, optim, timeout=timeout)
        else:
            result = run_processes(program, workload, steps, optim, backend=backend,
                                   timeout=timeout)
        reference = train_reference(original, steps, optim)
        return Verification(result.losses, reference.losses, compare(result, reference))


@dataclass(frozen=True)
class Verification:
    """A schedule's run beside the single-device run of the unmodified model."""

    losses: list[float]
    reference_losses: list[float]
    difference: Any  # runtime.reference.Difference

    def within(self, tolerance: float = 1e-5) -> bool:
        return self.difference.within(tolerance)

    def __str__(self) -> str:
        rows = [f"step {i}: loss {a:.6f}, one device {b:.6f}"
                for i, (a, b) in enumerate(zip(self.losses, self.reference_losses))]
        d = self.difference
        return "\n".join(rows + [f"largest relative difference: losses "
                                 f"{d.max_loss_rel_diff:.1e}, parameters "
                                 f"{d.max_param_rel_diff:.1e}"])


def _linear_then_bias(x: Any, weight: Any, bias: Any) -> Any:
    return F.linear(x, weight) + bias


def _product_then_bias(bias: Any, x: Any, weight: Any) -> Any:
    return torch.mm(x, weight) + bias


def _bias_split(op: Op) -> Callable[..., Any] | None:
    """How ``decompose`` splits an op's bias out: a function of its inputs, or None."""
    if len(set(op.inputs)) != 3:
        return None
    if op.kind == "linear":
        return _linear_then_bias
    scaled = any(op.kwargs.get(k, 1) != 1 for k in ("beta", "alpha"))
    if op.kind == "addmm" and not scaled and len(op.args) == 3:
        return _product_then_bias
    return None


def _common(paths: Iterable[str]) -> str:
    """The innermost module that holds all these module paths."""
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


def _label(fn: Any) -> str:
    return type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, "__name__", repr(fn))


def _join(path: str, name: str) -> str:
    """The path of ``name`` under module ``path`` ("" is the root)."""
    return f"{path}.{name}" if path else name


def _arg(value: Any) -> str:
    return "" if value is None else repr(value)


def schedule(model: nn.Module | Workload, example_inputs: Any = (), loss_fn: Any = None, *,
             devices: int, kwargs: dict[str, Any] | None = None, targets: tuple[Any, ...] = (),
             graph: Graph | None = None, knobs: dict[str, Any] | None = None) -> Schedule:
    """The root schedule of ``model`` on ``devices`` devices, captured on the example batch
    (as ``ct.capture`` takes it, or a ``Workload``); ``graph``: one captured already;
    ``knobs``: the values its ``knob`` calls return (a point ``ct.tune`` found)."""
    if devices < 1:
        raise ScheduleError(f"a schedule needs at least one device, got devices={devices}")
    if isinstance(model, Workload):
        workload = model
    else:
        if isinstance(example_inputs, dict):
            example_inputs, kwargs = (), {**example_inputs, **(kwargs or {})}
        inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
            else (example_inputs,)
        workload = Workload(model, inputs, dict(kwargs or {}), tuple(targets), loss_fn,
                            type(model).__name__)
    return Schedule(_State(workload, graph or capture(workload), devices, dict(knobs or {})))


def apply(fn: Callable[[Schedule], Any], sch: Schedule) -> Schedule:
    """``fn(sch)``, a schedule function; the knobs ``sch`` was given must be ones it asks
    for (a misspelt one would be ignored). A mistake in the function itself is reported
    as a ``ScheduleError`` that names it."""
    try:
        fn(sch)
    except ChronotopeError:
        raise
    except Exception as e:
        code = getattr(fn, "__code__", None)
        name = f"{Path(code.co_filename).name}:{fn.__qualname__}" if code else repr(fn)
        raise ScheduleError(f"the schedule function {name} raised {type(e).__name__}: "
                            f"{e}") from e
    asked = [name for name, _, _ in sch._state.knob_calls]
    unknown = sorted(set(sch._state.knobs) - set(asked))
    if unknown:
        raise ScheduleError(f"knob {unknown[0]!r} is not one the schedule asks for; it asks "
                            f"for {', '.join(asked) or 'none'}")
    return sch


def schedule_primitive(fn: Callable[..., Any] | None = None, *, name: str | None = None
                       ) -> Callable[..., Any]:
    """Register ``fn(sch, *args, **kwargs)`` as a primitive every schedule has, under its
    own name (or ``name``): ``sch["mod"].name(...)`` calls it. It is written with the other
    primitives, so everything it does lowers to the plan primitives and is checked alike."""
    def register(f: Callable[..., Any]) -> Callable[..., Any]:
        key = name or f.__name__
        if hasattr(Schedule, key):
            raise ScheduleError(f"{key!r} is a built-in schedule primitive; register yours "
                                "under another name")
        PRIMITIVES[key] = f
        return f
    return register(fn) if fn is not None else register
