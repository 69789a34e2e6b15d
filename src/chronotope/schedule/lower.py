"""How a module schedule's steps become a plan.

A ``shard`` cuts the ops of its module that read the parameter (or, where none does,
those of the nearest module above that does), along the dim the parameter's axis has
in their signature. The cut then flows forward the way
tensor parallelism follows it (``graph.axes.carry``): every op that reads a cut
tensor and can be cut alike is cut alike (the attention's heads between a column
and a row linear), until an op sums over the cut dim and leaves partial sums. A
``sync`` marks where a cut stretch ends: ``fwd_post`` on a module, for what leaves
it; ``fwd_pre``, for what enters it. Communication is still derived by the
compiler; the syncs are the schedule's statement of where it goes, and they are
checked: a cut or partial tensor that reaches an op which cannot take it must
pass a sync of the matching kind (all_gather for a cut, all_reduce for partial
sums, reduce_scatter for partial sums that go on cut along the sequence, the
Megatron sequence-parallel stretch, which a ``fwd_pre`` all_gather ends). Every
gradient reduction is derived too; a ``bwd_post`` sync is checked to sit on a
module whose input gradient is a partial sum.

The result is a ``policies.mesh.Choices`` (each op's cut, sequence dim, stage and
devices, and the ops checkpointed, swapped or fused) that ``mesh`` turns into ``op_trans`` /
``op_assign`` / ``op_order`` calls, with the schedule's micro-batches, pipeline order
and data-parallel replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chronotope.errors import ScheduleError
from chronotope.graph.axes import carry, sequence_dims
from chronotope.graph.ir import Graph, Op, PTensor, TensorKind
from chronotope.plan import Plan
from chronotope.plan.plan import Fusion
from chronotope.policies.mesh import Choices, TpSplit, fused_parts, mesh, still_fused

SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")
SYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter")
# what a sync turns a tensor's state into: (state, sync op) -> new state (None: whole)
_RESOLVES = {("partial", "all_reduce"): None, ("partial", "reduce_scatter"): "sequence",
             ("split", "all_gather"): None, ("sequence", "all_gather"): None}
_NEEDS = {"partial": "all_reduce", "split": "all_gather", "sequence": "all_gather"}
_STATE = {"partial": "partial sums", "split": "cut", "sequence": "cut along the sequence"}


@dataclass(frozen=True)
class Sync:
    """One ``sync`` step: where a sharded stretch ends, and with which collective."""

    module: str
    mode: str
    op: str

    def __str__(self) -> str:
        return f"sch[{self.module!r}].sync(mode={self.mode!r}, op={self.op!r})"


@dataclass(frozen=True)
class ShardStep:
    """One ``shard`` step: ``param`` (as the graph names it) cut along ``axis`` in the ops
    of ``module``; ``written`` is the name the schedule gave it."""

    module: str
    param: str
    written: str
    axis: int

    def __str__(self) -> str:
        return f"{ref(self.module)}.shard({self.written!r}, axis={self.axis})"


@dataclass
class Steps:
    """What a schedule's primitives recorded, by module path."""

    devices: int
    shards: list[ShardStep] = field(default_factory=list)
    syncs: list[Sync] = field(default_factory=list)
    recompute: set[str] = field(default_factory=set)  # op names
    swap: set[str] = field(default_factory=set)
    fused: dict[str, Fusion] = field(default_factory=dict)  # op name -> its fusion group
    cuts: list[str] = field(default_factory=list)  # modules a pipeline stage ends after
    micro: int = 1
    schedule: str = "1f1b"
    replicas: int = 1  # data-parallel groups
    placed: dict[str, tuple[int, ...]] = field(default_factory=dict)  # module -> devices


def module_of(op: Op) -> str:
    return op.source.module if op.source else ""


def inside(path: str, module: str) -> bool:
    """Whether module ``path`` is ``module`` or one of its descendants."""
    return not module or path == module or path.startswith(module + ".")


def ref(module: str) -> str:
    return f"sch[{module!r}]" if module else "sch"


def lower(graph: Graph, steps: Steps) -> Plan:
    """The plan the steps describe (see the module docstring)."""
    choices, tp, pp = analyse(graph, steps)
    return mesh(graph, dp=steps.replicas, tp=tp, pp=pp, micro=steps.micro,
                schedule=steps.schedule, choices=choices)


def analyse(graph: Graph, steps: Steps) -> tuple[Choices, int, int]:
    """Each op's cut, sequence dim, stage and devices; the tensor-parallel size of a stage
    and the number of stages."""
    group = steps.devices // steps.replicas
    pp = len(steps.cuts) + 1
    if group % pp:
        raise ScheduleError(f"{pp} pipeline stages (cut after {', '.join(steps.cuts)}) do not "
                            f"divide the {group} devices of each data-parallel group")
    tp = group // pp
    if steps.placed and pp > 1:
        raise ScheduleError(f"{ref(next(iter(steps.placed)))}.place(...) and pipeline stages "
                            "both say where ops run: use one of them")
    devices: dict[Op, tuple[int, ...]] = {}
    for op in graph.ops:
        owners = [m for m in steps.placed if inside(module_of(op), m)]
        if owners:
            devices[op] = steps.placed[max(owners, key=len)]  # the innermost placement
    for module, where in steps.placed.items():
        if max(where) >= tp:
            raise ScheduleError(f"{ref(module)}.place({list(where)}): each data-parallel "
                                f"group has devices 0..{tp - 1}")
    stage = stages(graph, steps.cuts) if steps.cuts else None
    flow = _Flow(graph, steps, tp, devices, stage or {})
    for op in graph.ops:
        flow.visit(op)
    flow.finish()
    return Choices(flow.splits, flow.seq, stage, devices, steps.recompute, steps.swap,
                  steps.fused), tp, pp


def stages(graph: Graph, cuts: list[str]) -> dict[Op, int]:
    """Each op's pipeline stage: how many cut modules end before it."""
    ends = []
    for module in cuts:
        at = [i for i, op in enumerate(graph.ops) if inside(module_of(op), module)]
        if not at:
            raise ScheduleError(f"{ref(module)}.cut_pipeline_stage(): {module} runs no op of "
                                f"the captured step")
        if at[-1] - at[0] + 1 != len(at):
            raise ScheduleError(
                f"{ref(module)}.cut_pipeline_stage(): {module}'s ops are not one stretch of "
                f"the step (other ops run between {graph.ops[at[0]].name} and "
                f"{graph.ops[at[-1]].name}: it is called more than once, or its parent "
                "computes between its children), so no stage can end after it; cut after a "
                "module that runs once, as a whole")
        if at[-1] == len(graph.ops) - 1:
            raise ScheduleError(f"{ref(module)}.cut_pipeline_stage(): nothing runs after "
                                f"{module}, so the last stage would be empty")
        ends.append(at[-1])
    if len(set(ends)) < len(ends):
        raise ScheduleError(f"two pipeline cuts end at the same op ({', '.join(cuts)}): "
                            "each stage needs ops of its own")
    ends.sort()
    return {op: sum(end < i for end in ends) for i, op in enumerate(graph.ops)}


class _Flow:
    """Follows the shards through the graph in program order (see the module docstring)."""

    def __init__(self, graph: Graph, steps: Steps, tp: int, devices: dict[Op, tuple[int, ...]],
                 stage: dict[Op, int]) -> None:
        self.graph, self.steps, self.tp = graph, steps, tp
        self.devices, self.stage = devices, stage
        self.made_by = {t: op for op in graph.ops for t in op.outputs}
        self.readers = graph.consumers()
        self.state: dict[PTensor, str] = {}  # "split", "partial" or "sequence"
        self.axis: dict[PTensor, int] = {}  # the cut axis of a split or sequence tensor
        self.fused: dict[PTensor, int] = {}  # a cut tensor's fused parts (q, k, v side by side)
        self.origin: dict[PTensor, str] = {}  # the module whose shard a cut tensor comes from
        self.splits: dict[Op, TpSplit | None] = {}
        self.seq: dict[Op, str | None] = {}
        self.used: set[Sync] = set()
        self.used_shards: set[ShardStep] = set()
        self.grad_sums: dict[Op, str] = {}  # cut op -> how its input gradient is summed
        self.seq_dims = sequence_dims(graph) if any(
            s.op == "reduce_scatter" for s in steps.syncs) else {}
        self.param_shards: dict[str, list[ShardStep]] = {}
        self.scope: dict[ShardStep, str] = {}  # the module whose ops a shard cuts
        for step in steps.shards:
            self.param_shards.setdefault(step.param, []).append(step)
            self.scope[step] = _reading(step, graph, self.readers)

    def where(self, op: Op) -> tuple[int, tuple[int, ...] | None]:
        return self.stage.get(op, 0), self.devices.get(op)

    def parts(self, op: Op) -> int:
        return len(self.devices.get(op) or range(self.tp))

    # ---- one op -------------------------------------------------------------------------

    def visit(self, op: Op) -> None:
        cuts: list[tuple[str, str]] = []  # (dim, what asks for it)
        origin = ""  # the module the cut comes from: this op's, when it reads a shard
        sequence_in: Op | None = None  # the maker of an input cut along the sequence
        gathered = whole_in = False
        for i, t in enumerate(op.inputs):
            state = self.state.get(t)
            if t.kind is TensorKind.PARAM:
                mine = self._param_cuts(op, i, t)
                cuts += mine
                origin = module_of(op) if mine else origin
                continue
            if state is None:
                whole_in |= t in self.made_by  # an activation: its gradient flows back
                continue
            maker = self.made_by[t]
            for sync in self._crossed(maker, op):
                new = self._resolve(sync, state, t, maker)
                gathered |= state == "sequence" and new is None
                state = new
                if state is None:
                    break
            if state is None:
                whole_in = True
            elif state == "sequence":
                sequence_in = maker
            elif state == "partial":
                self._summed_inside(maker, op, t, ("all_reduce", "reduce_scatter"))
                whole_in = True
            else:  # cut: op takes it cut alike, or the maker's module gathers it inside
                dim = self._carried(op, i, t, maker)
                if dim is None:
                    self._summed_inside(maker, op, t, ("all_gather",))
                    whole_in = True
                else:
                    cuts.append((dim, f"{t.name} (cut by {maker.name})"))
                    origin = origin or self.origin[t]
        dims = {d for d, _ in cuts}
        if len(dims) > 1:
            raise ScheduleError(
                f"op {op.name} ({_where(op)}) would be cut two ways: "
                + "; ".join(f"along {d} for {why}" for d, why in cuts)
                + ". Shard its parameters along one dim, or sync what reaches it")
        if dims:
            if sequence_in:
                raise self._needs_gather(op, sequence_in)
            self._cut(op, dims.pop(), cuts, "all_reduce" if not gathered else "reduce_scatter",
                      whole_in or gathered, origin)
        elif sequence_in:
            self._cut_sequence(op, sequence_in)

    def _param_cuts(self, op: Op, i: int, t: PTensor) -> list[tuple[str, str]]:
        out = []
        for step in self.param_shards.get(t.name, ()):
            if not inside(module_of(op), self.scope[step]):
                continue
            self.used_shards.add(step)
            sig, axis = op.signature, step.axis
            lead = sig.inputs[i][axis].factors[0] if sig and axis < len(sig.inputs[i]) else None
            if lead is None or not lead.splittable or lead.name not in sig.splittable():
                why = "it has no signature" if sig is None else \
                    f"its signature {sig} does not split that axis"
                raise ScheduleError(
                    f"{step}: op {op.name} ({_where(op)}) reads {t.name} but cannot be cut "
                    f"along axis {axis}: {why}. Shard another axis, or give the op a signature "
                    "(@chronotope.register_op)")
            out.append((lead.name, str(step)))
        return out

    def _carried(self, op: Op, i: int, t: PTensor, maker: Op) -> str | None:
        """The dim along which ``op`` takes its ``i``-th input cut as it is, if it can."""
        sig = op.signature
        axis = self.axis[t]
        if sig is None or axis >= len(sig.inputs[i]) or self.where(op) != self.where(maker):
            return None
        lead = sig.inputs[i][axis].factors[0]
        if lead.size is not None or lead.name not in sig.splittable():
            return None
        sizes = sig.bind(op.input_shapes, [o.shape for o in op.outputs])
        return lead.name if sizes[lead.name] % self.parts(op) == 0 else None

    def _cut(self, op: Op, dim: str, why: list[tuple[str, str]], grad_sum: str,
             whole_in: bool, origin: str) -> None:
        sig = op.signature
        sizes = sig.bind(op.input_shapes, [o.shape for o in op.outputs])
        reduces = sig.dim(dim).reduce
        chunks = still_fused(op, self.fused)
        if not reduces and op.outputs and any(t.kind is TensorKind.PARAM for t in op.inputs):
            chunks = fused_parts(op.outputs[0], self.readers)
        n = self.parts(op)
        if sizes[dim] % (chunks * n):
            parts = f"{chunks} fused parts x {n} devices" if chunks > 1 else f"{n} devices"
            raise ScheduleError(
                f"{why[0][1]}: op {op.name} ({_where(op)}) would cut its dim {dim} of size "
                f"{sizes[dim]} into {parts}, which does not divide it. Choose a device count "
                "that divides it, or leave this module whole")
        self.splits[op] = TpSplit(dim, chunks)
        if whole_in and not reduces:
            self.grad_sums[op] = grad_sum
        if reduces:
            for t in op.outputs:
                self.state[t], self.origin[t] = "partial", module_of(op)
            return
        marks: dict[PTensor, int] = {}
        carry(op, dim, marks)
        for t, axis in marks.items():
            self.state[t], self.axis[t], self.origin[t] = "split", axis, origin
            if chunks > 1:
                self.fused[t] = chunks

    def _cut_sequence(self, op: Op, maker: Op) -> None:
        dim = self.seq_dims.get(op)
        sig = op.signature
        if dim is None or sig is None or sig.bind(
                op.input_shapes, [o.shape for o in op.outputs])[dim] % self.parts(op):
            raise self._needs_gather(op, maker)
        self.seq[op] = dim
        marks: dict[PTensor, int] = {}
        carry(op, dim, marks)
        for t, axis in marks.items():
            self.state[t], self.axis[t] = "sequence", axis

    # ---- syncs --------------------------------------------------------------------------

    def _crossed(self, maker: Op, reader: Op) -> list[Sync]:
        """The syncs a tensor passes from ``maker`` to ``reader``: out of the maker's
        modules (innermost first), then into the reader's (outermost first)."""
        a, b = module_of(maker), module_of(reader)
        out = [s for s in self.steps.syncs
               if s.mode == "fwd_post" and inside(a, s.module) and not inside(b, s.module)]
        into = [s for s in self.steps.syncs
                if s.mode == "fwd_pre" and inside(b, s.module) and not inside(a, s.module)]
        return sorted(out, key=lambda s: -len(s.module)) + sorted(into, key=lambda s: len(s.module))

    def _resolve(self, sync: Sync, state: str, t: PTensor, maker: Op) -> str | None:
        if (state, sync.op) not in _RESOLVES:
            raise ScheduleError(
                f"{sync}: {t.name} (made by {maker.name}, {_where(maker)}) reaches it as "
                f"{_STATE[state]}, which {sync.op} does not make whole; use "
                f"op={_NEEDS[state]!r}")
        self.used.add(sync)
        return _RESOLVES[(state, sync.op)]

    def _summed_inside(self, maker: Op, reader: Op, t: PTensor, kinds: tuple[str, ...]) -> None:
        """A cut or partial tensor that an op of the same synced module reads whole: the
        module's ``fwd_post`` sync is made where that op reads it. Else a sync is missing."""
        for s in self.steps.syncs:
            if s.mode == "fwd_post" and s.op in kinds and inside(module_of(maker), s.module) \
                    and inside(module_of(reader), s.module):
                self.used.add(s)
                return
        state = self.state[t]
        raise ScheduleError(
            f"the output {t.name} of op {maker.name} ({_where(maker)}) is {_STATE[state]}; op "
            f"{reader.name} ({_where(reader)}) cannot take it so"
            f"{self._why_not(reader, t, maker)}, and no sync makes it whole on the way: add "
            f"{ref(self.origin[t])}.sync(mode='fwd_post', op={_NEEDS[state]!r})"
            + ("" if state == "partial" else
               f", or shard {module_of(reader) or 'the op'} alike"))

    def _why_not(self, reader: Op, t: PTensor, maker: Op) -> str:
        if self.state[t] != "split":
            return ""
        if self.where(reader) != self.where(maker):
            return " (it runs on other devices)"
        if reader.signature is None:
            return " (it has no signature)"
        return ""

    def _needs_gather(self, op: Op, maker: Op) -> ScheduleError:
        fix = f"{ref(module_of(op))}.sync(mode='fwd_pre', op='all_gather')" if module_of(op) \
            else f"{ref(module_of(maker))}.sync(mode='fwd_post', op='all_gather')"
        return ScheduleError(
            f"op {op.name} ({_where(op)}) reads {maker.name}'s output, which a reduce_scatter "
            f"sync left cut along the sequence, but it cannot run on a part of the sequence: "
            f"add {fix}")

    # ---- at the end ---------------------------------------------------------------------

    def finish(self) -> None:
        loss = self.graph.loss
        if loss in self.state:
            maker = self.made_by[loss]
            raise ScheduleError(f"the loss ({maker.name}, {_where(maker)}) comes out "
                                f"{_STATE[self.state[loss]]}: sync the module that makes it "
                                f"with op={_NEEDS[self.state[loss]]!r}")
        for step in self.steps.shards:
            if step not in self.used_shards:
                raise ScheduleError(f"{step}: no op of {step.module or 'the model'} reads "
                                    f"{step.param} in the captured step")
        for sync in self.steps.syncs:
            if sync.mode == "bwd_post":
                self._check_backward(sync)
            elif sync.mode == "fwd_post" and sync not in self.used:
                # (a fwd_pre sync may find its input whole: the first block of a stretch)
                raise ScheduleError(
                    f"{sync}: nothing cut or partial leaves {sync.module or 'the model'}, so "
                    "the sync has nothing to do; put it on the module whose output is "
                    "sharded, or remove it")

    def _check_backward(self, sync: Sync) -> None:
        found = [op for op in self.grad_sums if inside(module_of(op), sync.module)] or [
            op for op in self.grad_sums  # a module whose weights its parent reads itself
            if any(t.kind is TensorKind.PARAM and inside(t.name.rpartition(".")[0], sync.module)
                   for t in op.inputs)]
        if any(self.grad_sums[op] == sync.op for op in found):
            return
        what = (f"its cut ops' input gradients are summed with {self.grad_sums[found[0]]}"
                if found else "no cut op in it reads a whole input, so no input gradient of "
                "it is a partial sum")
        raise ScheduleError(f"{sync}: {what}; chronotope derives gradient reductions itself, "
                            "and this sync says something else: remove it or fix its op")


def _reading(step: ShardStep, graph: Graph, readers: dict[PTensor, list[Op]]) -> str:
    """The module whose ops a shard cuts: its own, or where none of them reads the
    parameter, the nearest module above that does (one that uses its child's weight
    itself, as a module ``replace`` brought may)."""
    param = graph.params.get(step.param)
    modules = [module_of(op) for op in readers.get(param, ())] if param is not None else []
    scope = step.module
    while scope and modules and not any(inside(m, scope) for m in modules):
        scope = scope.rpartition(".")[0]
    return scope


def _where(op: Op) -> str:
    return f"module {module_of(op)}" if module_of(op) else "top level"

