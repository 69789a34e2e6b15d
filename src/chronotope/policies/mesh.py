"""Data, tensor and sequence parallelism on a ``dp x tp`` device mesh, from the primitives.

Data parallel splits every op along the batch (``axes.batch_dims``); ops that
never see the batch are replicated, and so are ops that read the batch but cannot
split it (no signature, or a frozen batch dim): the plan lists them in
``plan.unsplit``, since every device then runs them on the whole batch.

Within each data-parallel group of ``tp`` devices, tensor parallelism (Megatron)
splits a linear whose input is whole along its output features (column), follows
that split through the ops after it (heads of the attention, the MLP's
activation), and a linear that reads it on its reduced dim is split there (row),
so its outputs are partial sums: one all-reduce after each column/row pair
forward, and one in backward where the column linears' input gradients meet.
Everything else is replicated, or with ``sequence=True`` (Megatron sequence
parallel) split along the sequence, which turns those all-reduces into
all-gathers before the column linears and reduce-scatters after the row linears.
Communication is derived by the compiler from the pieces' masks, so any model
whose ops have signatures works.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from chronotope.cost import op_flops
from chronotope.errors import PlanError
from chronotope.graph.axes import (
    batch_dims,
    batch_start,
    carried_dim,
    carry,
    cut_back,
    feeders,
    loss_tails,
    sequence_dims,
    trail,
)
from chronotope.graph.ir import Graph, Op, PTensor, TensorKind
from chronotope.graph.mask import Mask, equal_runs
from chronotope.graph.signature import Dim
from chronotope.plan import Plan, Replicate, Split, ValueSplit
from chronotope.plan.check import data_edges
from chronotope.plan.plan import Fusion, PlanOp
from chronotope.plan.steps import Kind, cells_of
from chronotope.policies.context import context
from chronotope.policies.context import cut as context_cut
from chronotope.policies.pipeline import (
    DIRECTIONS,
    MULTI_STAGE,
    RECYCLING,
    SCHEDULES,
    UNFOLDED,
    Schedule,
    Step,
)


@dataclass(frozen=True)
class TpSplit:
    """How tensor parallelism splits one op (``plan.trans`` with ``Split``): along its
    signature's ``dim``, first into ``chunks`` equal runs. An op's partition, not a
    tensor's placement (``compile/rvd.py``'s ``shard(d)`` is that).

    A fused projection (q, k and v side by side) is cut into its ``chunks`` first,
    so that device ``j`` gets part ``j`` of each and its readers find them locally;
    ``of``: the dim the chunks are cut along where it is not ``dim`` (the reshape that
    stacks q, k and v on an axis of their own: cut along it, then along the heads).
    """

    dim: str
    chunks: int = 1
    of: str | None = None


@dataclass
class Choices:
    """Per-op choices a caller makes in place of ``mesh``'s own (the module schedule
    language does): how tensor parallelism cuts each op, the sequence dim it splits where
    it is not cut, its pipeline stage, which of its group's devices run it, and which
    ops' activations are made again or swapped (besides ``recompute`` and ``swap``)."""

    splits: dict[Op, TpSplit | None] = field(default_factory=dict)
    seq: dict[Op, str | None] = field(default_factory=dict)
    stage: dict[Op, int] | None = None  # None: ``stages`` cuts the model
    devices: dict[Op, tuple[int, ...]] = field(default_factory=dict)  # in the group; no pp
    recompute: set[str] = field(default_factory=set)  # ops made again in their backward
    swap: set[str] = field(default_factory=set)  # ops whose saved tensors wait on the CPU
    fused: dict[str, Fusion] = field(default_factory=dict)  # ops run in one compiled function


def tensor_parallel_dims(graph: Graph, parts: int, experts: bool = True
                         ) -> dict[Op, TpSplit | None]:
    """For each op, how Megatron tensor parallelism over ``parts`` devices cuts it; with
    ``experts``, each Mixture-of-Experts layer's hidden features too (not under sequence
    parallelism: there each lane routes its own tokens through whole experts, exchanging
    them with its lane of the other members, where a lane's part of every expert would
    read all of its group's tokens).

    Column-parallel projections widen and the row-parallel ones that sum their parts
    narrow back. A narrowing projection whose cut a widening one would sum (a low-rank
    pair: latent attention's down- and up-projections) is left whole instead, so that the
    widening one is cut by its output features, and what they reach (attention's heads)
    with it."""
    whole: set[Op] = set()
    tried: set[Op] = set()
    while True:
        out, inverted, _ = _tensor_parallel_dims(graph, parts, experts, whole)
        trial = {n: w for n, w in inverted.items() if n not in tried}
        if not trial:
            return out
        tried |= trial.keys()
        # kept whole only where the widening one's cut then reaches a projection that sums
        # it, no norm between (its heads through attention to the output projection)
        closed = _tensor_parallel_dims(graph, parts, experts, whole | trial.keys())[2]
        whole |= {n for n, w in trial.items() if w in closed}


def _tensor_parallel_dims(graph: Graph, parts: int, experts: bool, whole: set[Op]
                          ) -> tuple[dict[Op, TpSplit | None], dict[Op, Op], set[Op]]:
    """``tensor_parallel_dims`` with the projections in ``whole`` left whole; the narrowing
    projections whose cut a widening projection sums (with it); and the column-parallel
    projections whose cut a projection sums, no op between reading it with a sum over it
    (a norm: the features times their mean's inverse root)."""
    readers = _readers(graph)
    reader = feeders(graph)
    weights = {t for op in reader for t in op.outputs}
    axis: dict[PTensor, int] = {}
    # the column-parallel projections a cut axis comes from, each with whether no op on
    # its way from there summed over it
    origins: dict[PTensor, dict[Op, bool]] = {}
    partial: dict[PTensor, set[Op]] = {}  # made from a sum over such an axis (a norm's mean)
    fused: dict[PTensor, int] = {}
    out: dict[Op, TpSplit | None] = {}
    inverted: dict[Op, Op] = {}
    closed: set[Op] = set()
    for op in graph.ops:
        out[op] = None
        if op.signature is None:
            continue
        sizes = op.signature.bind(op.input_shapes, [t.shape for t in op.outputs])
        dim = carried_dim(op, axis)
        made: dict[Op, bool] = {}
        mixed = set().union(*(partial.get(t, ()) for t in op.inputs))
        if mixed:
            partial.update(dict.fromkeys(op.outputs, mixed))
        if dim is not None:
            chunks = still_fused(op, fused)
            came = {o: c for t in op.inputs if t in axis for o, c in origins.get(t, {}).items()}
            widths = _widths(op, weights)
            if widths is not None and widths[0] == dim:  # a row-parallel projection
                closed |= {o for o, c in came.items() if c}
                if sizes[dim] < sizes[widths[1]]:  # it widens
                    inverted.update({o: op for o in came if _narrows(o, weights)})
            else:
                made = {o: c and o not in mixed for o, c in came.items()}
                if any(d.reduce for a in op.signature.inputs for ax in a for d in ax.factors
                       if d.name == dim):
                    partial.update(dict.fromkeys(op.outputs, mixed | set(came)))
        elif op not in whole and (dim := column_dim(op, weights)) is not None:
            chunks = fused_parts(op.outputs[0], readers)
            made = {op: True}
        elif op.kind == "experts" and experts:  # each device its part of the hidden features
            dim, chunks = "f", 1
        heads = _unstacked(op, dim, fused, sizes) if dim is not None else None
        if heads is not None:
            split = TpSplit(heads, fused[op.inputs[0]], dim) if sizes[heads] % parts == 0 \
                else None
        else:
            split = TpSplit(dim, chunks) if dim is not None and \
                sizes[dim] % (chunks * parts) == 0 else None
        if split is not None:
            carry(op, split.dim, axis)
            if split.of is None:
                fused.update({t: split.chunks for t in op.outputs if split.chunks > 1})
            if made:
                origins.update(dict.fromkeys(op.outputs, made))
        out[op] = split
    # what makes a split op's weights from parameters is cut alike: each device keeps its
    # part of the parameter
    for op, dim in cut_back(graph, {op: s.dim for op, s in out.items() if s}).items():
        if out[op] is None:
            chunks = out[reader[op]].chunks  # type: ignore[union-attr]
            assert op.signature is not None  # (a feeder has one)
            sizes = op.signature.bind(op.input_shapes, [t.shape for t in op.outputs])
            out[op] = TpSplit(dim, chunks) if sizes[dim] % (chunks * parts) == 0 else None
    return out, inverted, closed


def _widths(op: Op, weights: Collection[PTensor]) -> tuple[str, str] | None:
    """A projection by a weight matrix's (input, output) feature dims: the one its 2-D
    weight sums over and the one it makes."""
    for summed, kept in _weight_dims(op, weights):
        if len(summed) == 1 and len(kept) == 1:
            return summed[0].name, kept[0].name
    return None


def _weight_dims(op: Op, weights: Collection[PTensor]) -> Iterator[tuple[list[Dim], list[Dim]]]:
    """For each 2-D weight ``op`` reads (a parameter, or made from parameters: among
    ``weights``), its dims the op sums over and those that reach the output."""
    sig = op.signature
    if sig is None or not op.outputs:
        return
    made = {a.factors[0].name for a in sig.outputs[0]}
    for t, tdims in zip(op.inputs, sig.inputs):
        if (t.kind is not TensorKind.PARAM and t not in weights) or len(tdims) != 2:
            continue
        leads = [a.factors[0] for a in tdims]
        yield [d for d in leads if d.reduce], [d for d in leads if not d.reduce and d.name in made]


def _narrows(op: Op, weights: Collection[PTensor]) -> bool:
    """Whether a projection makes fewer features than it reads."""
    widths = _widths(op, weights)
    if widths is None:
        return False
    assert op.signature is not None  # (a projection has one)
    sizes = op.signature.bind(op.input_shapes, [t.shape for t in op.outputs])
    return sizes[widths[1]] < sizes[widths[0]]


def _readers(graph: Graph) -> dict[PTensor, list[Op]]:
    readers: dict[PTensor, list[Op]] = defaultdict(list)
    for op in graph.ops:
        for t in op.inputs:
            readers[t].append(op)
    return readers


def _splits_nothing(graph: Graph, tp: int) -> str:
    """Why tensor parallelism over ``tp`` devices would only replicate ``graph``."""
    readers = _readers(graph)
    weights = {t for op in feeders(graph) for t in op.outputs}
    widths: dict[int, str] = {}  # a projection's output features (of each fused part) -> op
    for op in graph.ops:
        if column_dim(op, weights) is not None:
            widths.setdefault(op.outputs[0].shape[-1] // fused_parts(op.outputs[0], readers),
                              op.name)
    found = f"its projections' output features do not divide by {tp}: " + ", ".join(
        f"{n} ({op})" for n, op in sorted(widths.items())) if widths else \
        "it has no projection by a weight matrix to split"
    return (f"tensor parallelism over {tp} devices splits nothing in {graph.name}: {found}; "
            f"pick a tp that divides them, or another policy")


def column_dim(op: Op, weights: Collection[PTensor] = ()) -> str | None:
    """The output features of a projection by a weight matrix (a linear, a Conv1D's
    ``addmm``, a matmul by a slice or transpose of a parameter, among ``weights``): the
    dim of its 2-D weight that is no sum and reaches the output, where the other one is
    summed over. A column-parallel cut splits it."""
    for summed, kept in _weight_dims(op, weights):
        out = [d for d in kept if d.splittable]
        if len(out) == 1 and summed:
            return out[0].name
    return None


def still_fused(op: Op, fused: dict[PTensor, int]) -> int:
    """The fused parts ``op`` keeps of its input's (see ``fused_parts``): a reshape that
    keeps the last axis keeps them; a reader that slices one part out does not."""
    t = op.inputs[0] if op.inputs else None
    if op.kind == "reshape" and t in fused and op.outputs[0].shape[-1:] == t.shape[-1:]:
        return fused[t]
    return 1


def fused_parts(t: PTensor, readers: dict[PTensor, list[Op]]) -> int:
    """How many equal runs of ``t``'s last axis its slicing readers take (q, k, v: 3),
    through reshapes that keep the last axis (a Conv1D's 2-D output made 3-D again), or
    how many parts a reshape stacks it into that are then sliced apart (``stacked``)."""
    while len(readers.get(t, ())) == 1:
        only = readers[t][0]
        if only.kind != "reshape" or only.outputs[0].shape[-1:] != t.shape[-1:]:
            return stacked(t, only, readers)
        t = only.outputs[0]
    return _runs(t, len(t.shape) - 1, readers)


def _runs(t: PTensor, a: int, readers: dict[PTensor, list[Op]]) -> int:
    """How many equal runs of ``t``'s axis ``a`` its slicing readers take (1: none)."""
    runs = sorted({op.region[a] for op in readers.get(t, ())
                   if op.region is not None and op.inputs[0] is t})
    if len(runs) < 2 or equal_runs(Mask(((0, t.shape[a]),)), [Mask((r,)) for r in runs]) is None:
        return 1
    return len(runs)


def stacked(t: PTensor, reshape: Op, readers: dict[PTensor, list[Op]]) -> int:
    """The parts of ``t``'s last axis a reshape stacks on an axis of their own that its
    readers then slice apart, through permutes: ``qkv(x).view(b, n, 3, heads, d)
    .permute(2, 0, 3, 1, 4)`` and ``q, k, v = qkv[0], qkv[1], qkv[2]`` (1: none)."""
    sig = reshape.signature
    if reshape.kind != "reshape" or sig is None or len(sig.inputs[0][-1].factors) < 3:
        return 1
    lead = sig.inputs[0][-1].factors[0].name
    u = reshape.outputs[0]
    a = next((i for i, ax in enumerate(sig.outputs[0]) if ax.factors[0].name == lead), None)
    while a is not None and len(readers.get(u, ())) == 1 and readers[u][0].kind in (
            "permute", "transpose") and (p := readers[u][0]).signature is not None:
        name = p.signature.inputs[0][a].factors[0].name
        a = next((i for i, ax in enumerate(p.signature.outputs[0])
                  if ax.factors[0].name == name), None)
        u = p.outputs[0]
    return 1 if a is None else _runs(u, a, readers)


def _unstacked(op: Op, dim: str, fused: dict[PTensor, int], sizes: dict[str, int]
               ) -> str | None:
    """Where ``op`` is the reshape that stacks a fused input's parts on an axis of their
    own (``stacked``): the dim after that axis (the heads), which each part is cut along."""
    t = op.inputs[0] if op.inputs else None
    if op.kind != "reshape" or t not in fused or sizes.get(dim) != fused[t]:
        return None
    assert op.signature is not None
    factors = [f.name for f in op.signature.inputs[0][-1].factors]
    return factors[1] if factors[0] == dim and len(factors) > 2 else None


def recycled_stages(graph: Graph, pp: int) -> tuple[dict[Op, int], int]:
    """For a model that runs itself again (recycling), each op's stage ``k * pp + s``:
    pass ``k`` (counted each time its first module runs again), and the stage ``s``
    its module has in the last pass, which is cut as ``stages`` cuts a model. Ops of no
    module go with the op before them, and no op runs on an earlier stage of its pass than
    what it reads from that pass (a module that runs twice in a pass would otherwise send
    a step's data back up the pipeline). Returns the stages and the number of passes."""
    mods = [op.source.module if op.source else "" for op in graph.ops]
    first = next((m for m in mods if m), "")
    pass_of, k = {}, -1
    for i, (op, mod) in enumerate(zip(graph.ops, mods)):
        if first and mod == first and (i == 0 or mods[i - 1] != first):
            k += 1
        pass_of[op] = max(k, 0)
    passes = max(pass_of.values()) + 1
    last = [op for op in graph.ops if pass_of[op] == passes - 1]
    cut = stages(graph, pp, last)
    of_module: dict[str, int] = {}
    for op, mod in zip(graph.ops, mods):
        if op in cut and mod:
            of_module.setdefault(mod, cut[op])
    out: dict[Op, int] = {}
    previous = 0
    for op, mod in zip(graph.ops, mods):
        s = cut[op] if op in cut else of_module.get(mod, previous) if mod else previous
        s = max([s, *(out[p] - pass_of[op] * pp for t in op.inputs
                      if (p := t.producer) is not None and p in out
                      and pass_of[p] == pass_of[op])])
        out[op] = pass_of[op] * pp + s
        previous = s
    return out, passes


def stages(graph: Graph, pp: int, ops: Sequence[Op] | None = None,
           micro_batched: bool = True) -> dict[Op, int]:
    """Cut the ops, in program order, into ``pp`` runs of about equal compute (forward FLOPs
    by the signatures): each cut within half a stage of its share, where the fewest
    activations of the batch cross it. Between two transformer blocks only the residual
    stream does, so one message per micro-batch (tables made from weights alone, like
    rotary angles, do not count). ``ops``: cut only these (default: all)."""
    ops = graph.ops if ops is None else list(ops)
    batch_dim = batch_dims(graph)
    # every stage runs micro-batches, so every stage holds an op that carries the batch
    # (with one micro-batch, any op will do)
    carried = [0]
    for op in ops:
        carried.append(carried[-1] + (batch_dim[op] is not None or not micro_batched))
    if carried[-1] < pp:
        raise PlanError(f"{pp} pipeline stages need {pp} ops that carry the batch; "
                        f"{graph.name} has {carried[-1]}: use fewer stages")
    weight = [op_flops(op) for op in ops]
    before = [0.0]
    for w in weight:
        before.append(before[-1] + w)  # FLOPs of the ops before each cut position
    total = before[-1] or 1.0
    cuts = _crossing(ops, {t for op in ops if batch_dim[op] is not None for t in op.outputs})
    bounds, last = [], 0
    for k in range(1, pp):
        target = k * total / pp
        after = [i for i in range(last + 1, len(ops))
                 if carried[i] - carried[last] >= 1 and carried[-1] - carried[i] >= pp - k]
        near = [i for i in after if abs(before[i] - target) <= total / (2 * pp)] or after
        best = min(near, key=lambda i: (cuts[i], abs(before[i] - target)), default=len(ops))
        bounds.append(best)
        last = best
    out, stage = {}, 0
    for i, op in enumerate(ops):
        while stage < len(bounds) and i >= bounds[stage]:
            stage += 1
        out[op] = stage
    return out


def _crossing(ops: Sequence[Op], counted: set[PTensor] | None = None) -> list[int]:
    """For each cut position (before op i), how many activations made before it are read
    after it (of ``counted`` only, where given)."""
    made = {t: i for i, op in enumerate(ops) for t in op.outputs
            if counted is None or t in counted}
    last: dict[PTensor, int] = {}
    for i, op in enumerate(ops):
        for t in op.inputs:
            if t in made:
                last[t] = i
    delta = [0] * (len(ops) + 1)
    for t, end in last.items():
        delta[made[t] + 1] += 1
        delta[end + 1] -= 1
    out, running = [], 0
    for d in delta:
        running += d
        out.append(running)
    return out


def mesh(graph: Graph, dp: int = 1, tp: int = 1, *, pp: int = 1, micro: int = 1,
         sequence: bool = False, schedule: str | Schedule = "gpipe", chunks: int = 1,
         recompute: str | None = None, swap: str | None = None, coshard: int = 1,
         choices: Choices | None = None, fold: bool = False, cp: int = 1,
         cp_attention: str = "allgather", zigzag: bool | None = None, ep: int = 1) -> Plan:
    """``dp`` data-parallel groups, each ``pp`` pipeline stages of ``cp`` context-parallel
    groups of ``tp`` tensor-parallel devices: rank = ((i * pp + s) * cp + c) * tp + j.

    ``cp`` > 1 cuts every op along the sequence over the ``cp`` groups of a stage, and
    attention by ``cp_attention`` ("allgather", "ring" or "ulysses"), the sequence dealt
    out in a ``zigzag`` where attention is causal (see ``policies/context.py``).

    ``ep`` > 1 (expert parallel) shares each Mixture-of-Experts layer's experts out over
    groups of ``ep`` data-parallel replicas: every replica's tokens of a layer go through
    the experts of each member of its group, on that member, and their parts of each
    token's output come back to be summed (``graph/experts.py``); each device keeps
    ``1 / ep`` of the experts' weights, gradients and optimizer state.

    ``micro`` cuts each group's batch into micro-batches whose gradients the
    compiler sums (gradient accumulation); without stages each micro-batch's backward
    runs before the next one's forward, so one micro-batch's activations live at a time
    (unless an op needs every micro-batch, batch statistics). With stages, each stage runs its
    micro-batches' forwards and backwards in the order of ``schedule`` (see
    ``policies.pipeline``), written as ``plan.order`` calls; with ``chunks`` > 1
    the model is cut into ``pp * chunks`` stages, and each runs on the stage rank
    whose schedule lists it (``v % pp`` for interleaved, down and back up for zbv).
    ``recompute`` is ``"full"`` (keep only each block's output: every other
    activation is made again in the backward) or ``"selective"`` (make the attention
    again, keep the rest); ``swap`` picks ops the same way and keeps what they save
    for backward in CPU memory instead.

    ``coshard`` = C > 1 (co-shard): what tensor parallelism splits is cut into
    ``C * tp`` pieces, C on each device, run one after another and made again in
    their backward, so a device holds one piece's activations at a time (attention
    heads, MLP columns); with ``tp`` = 1 that is on one device.

    ``choices`` replace the tensor-parallel cuts, sequence dims and stages the policy
    would choose, and may run an op on some of its group's devices (without stages).

    ``fold``: the plan is written for micro-batch 0 alone (``Plan.micro_batches``), and
    the compiler runs every micro-batch from it in the schedule's order: plan, check and
    compile cost what one micro-batch costs, however many there are.
    """
    if dp < 1 or tp < 1 or pp < 1 or micro < 1 or coshard < 1 or cp < 1 or ep < 1:
        raise PlanError(f"a mesh needs dp, tp, pp, cp, ep, micro, coshard >= 1, got dp={dp}, "
                        f"tp={tp}, pp={pp}, cp={cp}, ep={ep}, micro={micro}, coshard={coshard}")
    if ep > 1:
        _check_experts(graph, dp, ep)
    if isinstance(schedule, str) and schedule not in SCHEDULES:
        raise PlanError(f"unknown pipeline schedule {schedule!r}; choose from "
                        f"{', '.join(SCHEDULES)}")
    # the built-in schedule whose shape this one keeps (a written Order's), if any
    family = schedule if isinstance(schedule, str) else getattr(schedule, "family", None)
    if chunks < 1 or (chunks > 1 and family is not None and family not in MULTI_STAGE):
        raise PlanError(f"{chunks} stages per rank need a schedule for several stages per "
                        f"rank ({', '.join(sorted(MULTI_STAGE))}), not {schedule!r}")
    batch = graph.batch_size
    if (dp > 1 or micro > 1) and batch % (dp * micro):
        raise PlanError(f"{dp} data-parallel groups x {micro} micro-batches need a batch "
                        f"divisible by {dp * micro}; the example batch has {batch} samples")
    ctx = context(graph, cp, cp_attention, zigzag)
    plan = Plan(graph, dp * pp * cp * tp)
    # the keys and values each rank gathers: freed after their forward, gathered again
    plan.regather = cp > 1 and cp_attention in ("allgather", "ring")
    plan.ring = cp > 1 and cp_attention == "ring"
    if choices is None:
        choices = Choices(tensor_parallel_dims(graph, tp * coshard, experts=not sequence)
                          if tp * coshard > 1 else {},
                          sequence_dims(graph) if sequence and tp > 1 else {})
        if tp > 1 and coshard == 1 and not any(choices.splits.values()) \
                and not any(choices.seq.values()):
            raise PlanError(_splits_nothing(graph, tp))
    if choices.devices and pp > 1:
        raise PlanError(f"ops placed on chosen devices need one pipeline stage, not pp={pp}")
    batch_dim, unsplit = trail(graph, batch_start(graph))
    tails = loss_tails(graph, batch_dim, plan.registry)
    data = data_only(graph)
    if (pp > 1 or fold) and micro > 1:  # before stages: what no micro-batch runs alone
        _refuse_barriers(graph, batch_dim, tails, data, schedule, micro)
    if choices.stage is not None:
        stage = choices.stage
    elif family in RECYCLING:  # stage k * pp + s: pass k of stage s
        stage, chunks = recycled_stages(graph, pp)
    else:
        stage = stages(graph, pp * chunks, micro_batched=micro > 1)
    run = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    if fold and (family in UNFOLDED or coshard > 1):
        raise PlanError(f"fold runs one pipeline over the stages: not {family!r} or "
                        "co-shard; cut the micro-batches instead (fold=False, no --fold)")
    fold = fold and micro > 1
    accumulating = pp == 1 and chunks == 1 and micro > 1 and schedule in ("gpipe", "1f1b") \
        and (fold or not barriers(graph, batch_dim, tails, data))
    if accumulating:  # one stage: each micro-batch's backward before the next's forward,
        run = SCHEDULES["1f1b"]  # so one micro-batch's activations live at a time
    orders = {r: run(r, pp, micro, chunks) for r in range(pp)} \
        if (pp > 1 or fold or accumulating) and micro > 1 else {}
    # several pipelines over the same ranks (chimera): each its own copy of the stages,
    # numbered after the previous one's, and its share of the batch and micro-batches
    ways = DIRECTIONS.get(family, 1) if family and orders else 1
    rank_of = _placement(orders, pp, chunks * ways)
    if dp * ways > 1 or micro > 1:  # what cannot take its share of the batch runs on all of it
        plan.unsplit = unsplit
    splits, seq = choices.splits, choices.seq
    spans = _spans(graph, splits) if coshard > 1 else {}
    if coshard > 1 and not spans:
        raise PlanError(f"nothing in {graph.name} splits {tp * coshard} ways (tp {tp} x "
                        f"coshard {coshard}): heads and features must divide by it")
    sharded: dict[tuple[int, int, int], list[list[PlanOp]]] = defaultdict(
        lambda: [[] for _ in range(coshard)])  # (span, group, micro) -> pieces per part
    cells: dict[tuple[int, int, int], list[PlanOp]] = defaultdict(list)  # (group, stage, micro)
    # what makes the experts' weights (a slice of gate and up side by side) is cut along
    # the experts alike, so each member keeps its experts' part of the parameter
    shared = {op: dim for op, dim in cut_back(graph, {
        op: "e" for op in graph.ops if op.kind == "experts"}).items()
              if op.kind != "experts"} if ep > 1 else {}
    for op in graph.ops:
        if op in shared:
            groups = _shared_out(plan, op, shared[op], dp * ways, ep, ways)
        elif dp * ways > 1:
            groups = plan.trans(op, batch_cut(op, batch_dim, tails, dp * ways))
        else:
            groups = [plan.op(op.name)]
        for g, piece in enumerate(groups):
            i, v = g // ways, g % ways * pp * chunks + stage[op]  # group, (virtual) stage
            first = (i * pp + rank_of[v]) * cp * tp
            placed = choices.devices.get(op) or range(tp)
            micros = [piece]
            batched = op not in data and (batch_dim[op] is not None or op in tails)
            if micro > ways and batched:
                cut = batch_cut(op, batch_dim, tails, micro // ways)
                micros = [plan.template(piece, cut)] if fold else plan.trans(piece, cut)
            # what a template runs once for every micro-batch, from the inputs alone (a
            # count of the labels), each device of a context-parallel group makes whole:
            # a micro-batch's step then reads its rows of it
            cps = ctx if not (fold and op in data) else replace(ctx, cuts={}, tails={})
            # an experts part runs in the step of the replica whose device holds it, where
            # that replica's tokens are exchanged with its group's
            hosted = orders and batched and ep > 1 and op.kind == "experts"
            for m, sub in enumerate(micros):
                for c, part in context_cut(plan, sub, cps):
                    for host, at, piece in _experts_cut(plan, part, ep, i, first,
                                                        pp * cp * tp, (i // ep, m, c)):
                        parts = _tensor_parallel(plan, piece, splits.get(op), seq.get(op),
                                                 [at + c * tp + d for d in placed],
                                                 coshard if op in spans else 1)
                        if op in spans:
                            for k, pieces in enumerate(parts):
                                sharded[(spans[op], g, m)][k] += pieces
                        if hosted:
                            cells[(host, v, m)].append(piece)
                if orders and batched and not hosted:
                    cells[(i, v, m)].append(sub)
    plan.cells = dict(cells)
    keep = data | set(tails)
    for op in checkpointed(graph, recompute, "recompute", batch_dim, keep) + \
            [op for op in graph.ops if op.name in choices.recompute and op not in keep]:
        plan.recompute(op.name)
    for op in checkpointed(graph, swap, "swap", batch_dim, keep) + \
            [op for op in graph.ops if op.name in choices.swap and op not in keep]:
        plan.swap(op.name)
    for name, fusion in choices.fused.items():
        plan.fuse(name, fusion.group, fusion.backend)
    if fold:
        _fold(plan, cells, dp, cp * tp, micro, orders, rank_of)
    elif orders:
        _schedule(plan, cells, dp, micro // ways, orders, rank_of)
    apart = {key[0] for key, parts in sharded.items()
             if not _coshard(plan, parts, f"coshard{key[0]}.{key[1]}.{key[2]}")}
    if apart:
        runs = [next(op for op, i in spans.items() if i == span) for span in sorted(apart)]
        warnings.warn(f"co-shard: {len(runs)} runs read their pieces across the cut (a slice "
                      "of a cut axis) and run as tensor-parallel pieces, not one part after "
                      "another: those from " + ", ".join(
                          f"{op.name} ({op.source.module})" if op.source else op.name
                          for op in runs), stacklevel=2)
    return plan


def _spans(graph: Graph, splits: dict[Op, TpSplit | None]) -> dict[Op, int]:
    """Split ops connected through what they read from each other, numbered: the runs a
    co-shard part goes through before the next part starts. A run ends at its sum: what
    reads a sum's result needs every part's first, so it starts no part of the run (a
    residual stream cut along the features after a row-parallel projection would join
    the layers into one run, each part waiting on the others). Only runs that end in a
    sum (an attention, an MLP: a split reduced dim) are kept; a run whose pieces are read
    whole (a vocabulary projection) would only move its activations around."""
    made_by = {t: op for op in graph.ops for t in op.outputs}
    root: dict[Op, Op] = {}

    def find(op: Op) -> Op:
        while root[op] is not op:
            root[op] = root[root[op]]
            op = root[op]
        return op

    sums = {op for op, split in splits.items() if split is not None and _reduces(op, split.dim)}
    for op in graph.ops:
        if splits.get(op) is None:
            continue
        root[op] = op
        for t in op.inputs:
            other = made_by.get(t)
            if other in root and other not in sums:
                root[find(other)] = find(op)
    summed = {find(op) for op in sums}
    kept = summed - _reentered(graph, {op: find(op) for op in root}, made_by)
    ids: dict[Op, int] = {}
    return {op: ids.setdefault(find(op), len(ids)) for op in root if find(op) in kept}


def _reentered(graph: Graph, run: dict[Op, Op], made_by: dict[PTensor, Op]) -> set[Op]:
    """The runs that an op outside them reads and feeds back into (a residual stream cut
    along the features, beside a norm that reads all of it): its parts cannot run one
    after another, each part's way back waiting on every part."""
    left: dict[Op, set[Op]] = {}  # op -> the runs (not its own) it reads from, at any depth
    out: set[Op] = set()
    for op in graph.ops:
        came: set[Op] = set()
        for t in op.inputs:
            other = made_by.get(t)
            if other is None:
                continue
            if other in run:
                came.add(run[other])
            came |= left.get(other, set())
        if op in run:  # back in a run it left (its own run's reads are inside the run)
            out |= {run[op] for t in op.inputs if (other := made_by.get(t)) is not None
                    and run.get(other) is not run[op] and run[op] in left.get(other, ())}
            came.discard(run[op])
        if came:
            left[op] = came
    return out


def _reduces(op: Op, dim: str) -> bool:
    return any(d.name == dim and d.reduce for d in op.signature.dims())


def _coshard(plan: Plan, parts: list[list[PlanOp]], name: str) -> bool:
    """Co-shard parts run one after another, forward and backward, each made again right
    before its backward: one part's activations are alive at a time. Not where a piece
    reads a later part's (a slice across the cut: multi-query attention's keys taken out
    of a fused projection), which would wait on it: returns whether they were ordered."""
    part_of = {piece: c for c, pieces in enumerate(parts) for piece in pieces}
    if any(part_of[e.src] > part_of[e.dst]  # type: ignore[index]
           for e in data_edges([p for pieces in parts for p in pieces])):
        return False
    groups = [plan.group(pieces, f"{name}.{c}") for c, pieces in enumerate(parts)]
    learns = any(v.ptensor in plan.requires_grad for p in part_of for v in p.outputs)
    if learns:  # (a frozen layer has no backward to make them again for)
        for piece in part_of:
            if piece not in plan.swapped:
                plan.recompute(piece)
    for a, b in zip(groups, groups[1:]):
        plan.order(a, b)
        if learns:
            plan.order(plan.backward(a), plan.backward(b))
    return True


def checkpointed(graph: Graph, how: str | None, what: str, batch_dim: dict[Op, str | None],
                 keep: set[Op]) -> list[Op]:
    """The ops whose activations a recompute or swap policy does not keep on the device:
    ``"full"`` all but each block's output, ``"selective"`` the attention (never ``keep``)."""
    if how is None:
        return []
    if how == "selective":
        return [op for op in graph.ops if op.kind == "attention"]
    if how != "full":
        raise PlanError(f"unknown {what} policy {how!r}: use 'full' or 'selective'")
    cuts = _crossing(graph.ops)
    fewest = min(cuts[1:-1], default=0)
    return [op for i, op in enumerate(graph.ops)
            if batch_dim[op] is not None and op not in keep and cuts[i + 1] != fewest]


def data_only(graph: Graph) -> set[Op]:
    """Ops computed from the batch's inputs alone (label counts, masks): cheap, and needed
    whole by every micro-batch's loss, so they are not cut into micro-batches."""
    made_by = {t: op for op in graph.ops for t in op.outputs}
    out: set[Op] = set()
    for op in graph.ops:
        if op.inputs and all(t.kind is TensorKind.INPUT or made_by.get(t) in out
                             for t in op.inputs):
            out.add(op)
    return out


def barriers(graph: Graph, batch_dim: dict[Op, str | None], tails: dict[Op, tuple[int, ...]],
             data: set[Op]) -> list[tuple[Op, str]]:
    """Ops no micro-batch can run alone, with the reason: one that reads what micro-batches
    make but no dim of its signature carries the batch (it needs every micro-batch's part),
    or one that sums over the batch for ops that need the whole sum (batch statistics).
    Every micro-batch would wait for all the others there, which no pipeline schedule
    allows. The loss's tails and what is computed from the inputs alone are cut, or run
    whole before anything, as ``mesh`` does."""
    batched = {op for op in graph.ops
               if op not in data and (batch_dim[op] is not None or op in tails)}
    rows = set(batch_start(graph))  # the inputs, cut into micro-batches' rows
    readers = graph.consumers()
    found = []
    for op in graph.ops:
        if op in data:
            continue
        dim = batch_dim[op]
        if op in tails or (dim is not None and op.signature.dim(dim).reduce):
            # a sum over the batch (or what is linear in one) is cut into per micro-batch
            # shares, which only the loss's tails may read
            if any(r not in tails for t in op.outputs for r in readers.get(t, ())):
                found.append((op, "it makes a sum over the batch that what follows needs "
                              "whole (batch statistics, or a loss that is no sum over samples)"))
        elif dim is None and any(t.producer in batched or t in rows for t in op.inputs):
            found.append((op, "it reads the whole batch: no dim of its signature carries it"
                          if op.signature else "it has no signature, so it reads the whole batch"))
        elif dim is not None:
            whole = next((t for i, t in enumerate(op.inputs)
                          if _batched_output(t, batch_dim, batched, tails)
                          and not _names(op.signature.inputs[i], dim)), None)
            if whole is not None:
                found.append((op, f"each micro-batch's piece of it reads all of {whole.name}, "
                              "which the micro-batches make in parts: no dim of its signature "
                              "carries the batch into that input"))
    return found


def _names(dims: Sequence[Any], name: str) -> bool:
    """Whether signature dims (one tensor's) have a factor called ``name``."""
    return any(f.name == name for d in dims for f in d.factors)


def _batched_output(t: PTensor, batch_dim: dict[Op, str | None], batched: set[Op],
                    tails: dict[Op, tuple[int, ...]]) -> bool:
    """Whether ``t`` is made in parts by the micro-batches: along its batch axis, by an op
    that carries the batch without summing over it."""
    op = t.producer
    if op is None or op not in batched or op in tails or batch_dim[op] is None:
        return False
    dim = batch_dim[op]
    return not op.signature.dim(dim).reduce and \
        _names(op.signature.outputs[op.outputs.index(t)], dim)


def _refuse_barriers(graph: Graph, batch_dim: dict[Op, str | None],
                     tails: dict[Op, tuple[int, ...]], data: set[Op], schedule: str | Schedule,
                     micro: int) -> None:
    found = barriers(graph, batch_dim, tails, data)
    if not found:
        return
    op, why = found[0]
    where = f" at {op.source}" if op.source else ""
    more = f" (and {len(found) - 1} more: {', '.join(o.name for o, _ in found[1:4])}" \
        f"{'...' if len(found) > 4 else ''})" if len(found) > 1 else ""
    name = schedule if isinstance(schedule, str) else "this schedule"
    article = "an" if name[0] in "aeiou" else "a"
    raise PlanError(
        f"{article} {name} pipeline over {micro} micro-batches cannot run op {op.name} "
        f"({op.kind}{where}) once per micro-batch: {why}{more}. Every micro-batch would "
        "wait there for all the others. Use one micro-batch (micro=1, --micro 1), or, "
        "where the op treats samples independently, give it a signature naming its batch "
        "dim (@chronotope.register_op)")


def batch_cut(op: Op, batch_dim: dict[Op, str | None], tails: dict[Op, tuple[int, ...]],
              n: int):
    """How ``op`` splits ``n`` ways with the batch: along its batch dim, along the values
    of a loss tail, or replicated when it never sees the batch."""
    if op in tails:
        return ValueSplit(n, tails[op])
    return Split(batch_dim[op], n) if batch_dim[op] is not None else Replicate(n)


def _steps(steps: list) -> str:
    shown = ", ".join(f"{s}{k}{m}" for k, s, m in steps[:4])
    return shown + (f" and {len(steps) - 4} more" if len(steps) > 4 else "")


def _placement(orders: dict[int, list[Step]], pp: int, chunks: int) -> list[int]:
    """Each stage's rank: the one whose schedule runs it (round the ranks without one);
    ``chunks`` stages per rank."""
    if not orders:
        return [s % pp for s in range(pp * chunks)]
    found: dict[int, set[int]] = defaultdict(set)
    for r, order in orders.items():
        for _, s, _ in order:
            found[s].add(r)
    bad = [s for s in range(pp * chunks) if len(found[s]) != 1] + \
        [s for s in found if not 0 <= s < pp * chunks]
    if bad:
        s = bad[0]
        where = f"ranks {sorted(found[s])}" if found[s] else "no rank"
        raise PlanError(f"the schedule runs stage {s} on {where}: each of the {pp * chunks} "
                        f"stages ({pp} ranks x {chunks} per rank) needs exactly one rank")
    return [found[s].pop() for s in range(pp * chunks)]


def _schedule(plan: Plan, cells: dict[tuple[int, int, int], list[PlanOp]], dp: int, micro: int,
              orders: dict[int, list[Step]], rank_of: list[int]) -> None:
    """Order each stage rank's micro-batch groups as its schedule says; a schedule with
    weight-gradient steps (W) splits every backward first."""
    pp = len(orders)
    split = _split_for(plan, cells, orders)
    for i in range(dp):
        for r in range(pp):
            held = [s for s, rank in enumerate(rank_of) if rank == r]
            steps = {}
            for s in held:
                for m in range(micro):
                    if cells[(i, s, m)]:
                        forward = plan.group(cells[(i, s, m)], f"F{s}.{m}")
                        steps[Step(Kind.F, s, m)] = forward
                        if plan.leaves(plan.backward(forward)):
                            steps[Step(Kind.B, s, m)] = plan.backward(forward)
                        if split and plan.leaves(plan.weight(forward)):
                            steps[Step(Kind.W, s, m)] = plan.weight(forward)
            # a stage without parameters has no weight gradients to place, and one that
            # nothing trainable runs before (a frozen stem) no backward at all
            order = [step for step in orders[r] if step in steps or step.kind is Kind.F]
            unknown = [step for step in order if step not in steps]
            missing = [step for step in steps if step not in order]
            if unknown or missing:
                what = _steps(unknown) + " not on this rank" if unknown else \
                    _steps(missing) + " missing"
                kinds = "forward (F), backward (B) and weight gradient (W)" if split else \
                    "forward (F) and backward (B)"
                raise PlanError(f"the schedule of pipeline rank {r} does not fit the plan: "
                                f"{what}; rank {r} runs stages {held} x micro-batches "
                                f"0..{micro - 1}, {kinds}")
            order = [steps[step] for step in order]
            for before, after in zip(order, order[1:]):
                plan.order(before, after)


def _split_for(plan: Plan, cells: dict[tuple[int, int, int], list[PlanOp]],
               orders: dict[int, list[Step]]) -> bool:
    """Whether the schedule has weight-gradient steps (W): then every backward is split
    first."""
    split = any(kind == "W" for order in orders.values() for kind, _, _ in order)
    if split:
        plan.split_backward([p for pieces in cells.values() for p in pieces])
    return split


def _fold(plan: Plan, cells: dict[tuple[int, int, int], list[PlanOp]], dp: int, width: int,
          micro: int, orders: dict[int, list[Step]], rank_of: list[int]) -> None:
    """A template's steps: each of the ``width`` devices of stage rank ``r`` runs its
    schedule; a schedule with weight-gradient steps (W) splits every backward first."""
    pp = len(orders)
    _split_for(plan, cells, orders)
    # a stage without parameters has no weight-gradient step, and one that nothing
    # trainable runs before (a frozen stem) no backward at all
    made = set(cells_of(plan).values())
    steps = {}
    for i in range(dp):
        for r in range(pp):
            mine = [step for step in orders[r] if step.kind is Kind.F or step[:2] in made]
            for j in range(width):
                steps[(i * pp + r) * width + j] = mine
    plan.micro_batches(micro, steps)


def _check_experts(graph: Graph, dp: int, ep: int) -> None:
    """Expert parallelism over ``ep`` of ``dp`` replicas: refused by name where it cannot."""
    experts = [op for op in graph.ops if op.kind == "experts"]
    if not experts:
        raise PlanError(f"expert parallelism shares out Mixture-of-Experts layers' experts, "
                        f"and {graph.name} has none captured as routed experts "
                        "(chronotope.graph.experts): no experts op to cut (capture warns "
                        "which experts modules of a Hugging Face model run as written, and why)")
    if dp % ep:
        raise PlanError(f"expert parallelism over {ep} devices takes groups of {ep} of the "
                        f"{dp} data-parallel replicas: use an ep that divides dp")
    for op in experts:
        count = op.inputs[3].shape[0]
        if count % ep:
            raise PlanError(f"{op.name}: its {count} experts do not share out over {ep} "
                            "devices: use an ep that divides them")


def _experts_cut(plan: Plan, piece: PlanOp, ep: int, replica: int, first: int, width: int,
                 label: tuple[int, ...]) -> list[tuple[int, int, PlanOp]]:
    """An experts piece of data-parallel ``replica``'s tokens cut over the ``ep`` replicas
    of its group (each part on its replica's device at the place ``first`` names, replicas
    ``width`` devices apart), its tokens exchanged with the group's as ``label`` (group,
    micro-batch, sequence chunk) says; any other piece where it is. Each with the
    replica that holds it and where."""
    if ep == 1 or piece.op.kind != "experts":
        return [(replica, first, piece)]
    group = replica - replica % ep
    parts = plan.trans(piece, Split("e", ep))
    plan.exchanges.update(dict.fromkeys((part.name for part in parts), label))
    return [(group + r, first + (group + r - replica) * width, part)
            for r, part in enumerate(parts)]


def _shared_out(plan: Plan, op: Op, dim: str, replicas: int, ep: int, ways: int
                ) -> list[PlanOp]:
    """``op``'s piece for each of the ``replicas`` (``ways`` per data-parallel replica): one
    copy per group of ``ep`` replicas, cut along ``dim`` into the group's parts, part ``r``
    with replica ``r`` of the group, as ``_experts_cut`` places the experts."""
    copies = plan.trans(op, Replicate(replicas // ep)) if replicas > ep else [plan.op(op.name)]
    out: list[PlanOp] = [None] * replicas  # type: ignore[list-item]
    for c, copy in enumerate(copies):
        for r, part in enumerate(plan.trans(copy, Split(dim, ep))):
            out[((c // ways) * ep + r) * ways + c % ways] = part
    return out


def _tensor_parallel(plan: Plan, piece: PlanOp, tp: TpSplit | None, seq: str | None,
                     devices: Sequence[int], coshard: int = 1) -> list[list[PlanOp]]:
    """Split and place one piece over the tensor-parallel ``devices``; a sharded op is cut
    ``coshard`` times as many ways, consecutive pieces on one device. Returns the sharded
    pieces by co-shard part (empty when the op is not sharded)."""
    if tp is not None:
        n = len(devices) * coshard
        chunks = plan.trans(piece, Split(tp.of or tp.dim, tp.chunks)) if tp.chunks > 1 \
            else [piece]
        cut = [plan.trans(c, Split(tp.dim, n)) for c in chunks]
        for subs in cut:
            for k, sub in enumerate(subs):
                plan.assign(sub, devices[k // coshard])
        return [[subs[k] for subs in cut for k in range(c, n, coshard)] for c in range(coshard)]
    if len(devices) == 1:
        plan.assign(piece, devices[0])
        return []
    n = len(devices)
    if seq is not None and piece.piece.sizes.get(seq, 0) % n == 0:
        subs = plan.trans(piece, Split(seq, n))
    else:
        subs = plan.trans(piece, Replicate(n))
    for device, sub in zip(devices, subs):
        plan.assign(sub, device)
    return []


def data_parallel(graph: Graph, ndevices: int) -> Plan:
    """Each device runs 1/ndevices of the batch with a full copy of the weights."""
    return mesh(graph, dp=ndevices)


def tensor_parallel(graph: Graph, ndevices: int) -> Plan:
    """Megatron tensor parallelism: column/row-split linears, the rest replicated."""
    return mesh(graph, tp=ndevices)


def sequence_parallel(graph: Graph, ndevices: int) -> Plan:
    """Megatron tensor + sequence parallelism: what TP replicates is split along the sequence."""
    return mesh(graph, tp=ndevices, sequence=True)


def context_parallel(graph: Graph, cp: int, dp: int = 1, **options: Any) -> Plan:
    """Every op along the sequence over ``cp`` devices (times ``dp`` replicas), attention
    by ``cp_attention`` (see ``mesh`` and ``policies/context.py``)."""
    return mesh(graph, dp=dp, cp=cp, **options)


def expert_parallel(graph: Graph, ep: int, dp: int | None = None, **options: Any) -> Plan:
    """Data parallel over ``dp`` devices (default ``ep``), each Mixture-of-Experts layer's
    experts shared out over groups of ``ep`` of them (see ``mesh``)."""
    return mesh(graph, dp=dp or ep, ep=ep, **options)
