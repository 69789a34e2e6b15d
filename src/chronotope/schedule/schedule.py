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

import difflib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from chronotope.errors import ChronotopeError, ScheduleError
from chronotope.graph.capture import capture
from chronotope.graph.ir import Graph, Op
from chronotope.models.workload import Workload
from chronotope.plan import Plan
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

# ``@schedule_primitive`` functions, by name: ``sch[...].name(...)`` calls them
PRIMITIVES: dict[str, Callable[..., Any]] = {}


@dataclass(frozen=True)
class Subgraph:
    """Ops that ``find`` matched, in program order; ``checkpoint`` and ``swap`` take it."""

    ops: tuple[Op, ...]

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def __repr__(self) -> str:
        return f"Subgraph({', '.join(op.name for op in self.ops)})"


class _State:
    """What every sub-schedule of one schedule shares."""

    def __init__(self, workload: Workload, graph: Graph, devices: int,
                 knobs: dict[str, Any]) -> None:
        self.workload, self.graph = workload, graph
        self.steps = Steps(devices)
        self.log: list[str] = []
        self.knobs = knobs  # the values chosen for this run (the tuner's point)
        self.knob_calls: list[tuple[str, list[Any], Any]] = []  # (name, choices, value)
        self.modules = dict(workload.model.named_modules())
        # every name a parameter has in the model (tied weights have several) -> the graph's
        seen: dict[int, str] = {}
        self.params: dict[str, str] = {}
        self.sizes: dict[str, tuple[int, ...]] = {}
        for name, p in workload.model.named_parameters(remove_duplicate=False):
            self.params[name] = seen.setdefault(id(p), name)
            self.sizes[name] = tuple(p.shape)


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
        clash = names & other
        if clash:
            raise ScheduleError(f"{ref(self.path)}.{what}: {sorted(clash)[0]} is {done} "
                                "already; an op's activations are either made again or swapped")
        mine |= names
        self._record(f"{what}({_arg(subgraph)})")
        return self

    def _chosen(self, subgraph: Subgraph | Iterable[Subgraph] | None, what: str) -> set[str]:
        if subgraph is None:
            ops = self.ops()
        else:
            parts = [subgraph] if isinstance(subgraph, Subgraph) else list(subgraph)
            ops = [op for part in parts for op in part]
        if not ops:
            raise ScheduleError(f"{ref(self.path)}.{what}: no op to {what} "
                                f"({self.path or 'the model'} runs none, or the subgraph is "
                                "empty)")
        return {op.name for op in ops}

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
        device; report both runs' losses and how far the parameters (moved by the
        gradients) end apart. Ranks run as threads, or with ``backend`` ("gloo", "nccl")
        as processes."""
        from chronotope.compile import compile
        from chronotope.runtime.launch import run_processes
        from chronotope.runtime.local import run_in_threads
        from chronotope.runtime.optim import Optim
        from chronotope.runtime.reference import compare, train_reference

        optim = optim or Optim()
        program = compile(self.plan())
        workload = self._state.workload
        if backend is None:
            result = run_in_threads(program, workload, steps, optim, timeout=timeout)
        else:
            result = run_processes(program, workload, steps, optim, backend=backend,
                                   timeout=timeout)
        reference = train_reference(workload, steps, optim)
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
