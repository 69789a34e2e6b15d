"""Materialization: the communication a checked plan needs, derived from its masks.

For every piece a rank reads, the overlapping pieces that wrote it are found
(one replica per region, the local one first). A local piece of exactly the
right region is used as is; otherwise the parts are cut out, sent from other
ranks, and assembled: regions concatenated, partial values summed. A message
between the tokens' side and an experts piece of some of the experts carries only the
rows routed to them (``rows``: expert parallelism's dispatch and combine). After the
backward, each rank sums the gradient of every parameter region it stores,
and rank 0 assembles the loss (where every rank holds a share of it, as in data
parallel, the shares are summed in a gradient bucket rather than sent).

This is lowering, the first step of compile. Its state is two things: a
``ReadTable`` (what each read resolved to, so a second read of it takes the same
name) and the code it writes (``compile.arrange.Written``: each piece's reads, call
and sends, each rank's head and tail). The passes of ``compile/passes.py`` take it
from there, in order, ``arrange`` first.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from fractions import Fraction

import torch

from chronotope.compile.arrange import Written
from chronotope.compile.buckets import BUCKET_MB
from chronotope.compile.collectives import Refused, Stuck
from chronotope.compile.fold import batch_axes
from chronotope.compile.layout_changes import Change, Emitter, find_changes, placement
from chronotope.compile.names import Names
from chronotope.compile.passes import Lowered, run_passes
from chronotope.compile.program import (
    AllReduce,
    Assemble,
    Backward,
    CollectiveKind,
    Forward,
    GatherParams,
    Grad,
    Instruction,
    Key,
    Load,
    Loss,
    Part,
    Pattern,
    Program,
    PullParam,
    PushParam,
    Recv,
    ReduceScatter,
    Role,
    Rows,
    Send,
    SetBuffer,
    WeightGrad,
    covers,
    groups_of,
)
from chronotope.cost.network import Cluster
from chronotope.errors import PlanError
from chronotope.graph.experts import reach
from chronotope.graph.ir import PTensor, TensorKind
from chronotope.graph.mask import Mask, ValueRange, VTensor, covers_exactly_once, equal_runs
from chronotope.plan.check import CheckedPlan, Sources
from chronotope.plan.plan import PlanOp, placed
from chronotope.plan.steps import cells_of

_SOURCES = {TensorKind.PARAM: "param", TensorKind.BUFFER: "buffer",
            TensorKind.CONSTANT: "constant", TensorKind.INPUT: "input"}


def _overlap(a: Mask, b: Mask) -> Mask | None:
    """The index region two masks share (values aside)."""
    index = tuple((max(x, y), min(u, w)) for (x, u), (y, w) in zip(a.index, b.index))
    return Mask(index) if all(lo < hi for lo, hi in index) else None


@dataclass
class ReadTable:
    """What each read resolved to, so that every later read of the same thing on the same
    rank takes the same name and nothing is sent twice."""

    ndevices: int
    piece: dict[tuple[PlanOp, Mask, PTensor], str] = field(default_factory=dict)  # outputs
    local: list[dict[tuple[PTensor, Mask], str]] = field(init=False)  # what a rank holds
    # (producer, piece, region, tensor) a rank received, and under which name
    received: list[dict[tuple, str]] = field(init=False)
    params: dict[tuple, str] = field(default_factory=dict)  # (owner, reader, param, region)
    # a sender's sum of partial pieces it made, by (tensor, pieces): the piece it stands as
    summed: dict[tuple, tuple[PlanOp, Mask]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.local = [{} for _ in range(self.ndevices)]
        self.received = [{} for _ in range(self.ndevices)]


class Lowering:
    """Resolves every read of a checked plan into a ``ReadTable`` and writes the code it
    takes (``Written``); ``run`` then hands the code to the passes."""

    def __init__(self, checked: CheckedPlan, cluster: Cluster | None = None,
                 skip: frozenset = frozenset(), bucket_mb: float = BUCKET_MB,
                 refused: frozenset[Key] = frozenset()) -> None:
        self.cluster = cluster  # None: no searched layout changes (plain messages)
        self.refused = refused  # collectives the passes refused: these reads are messages
        self.bucket_bytes = bucket_mb * 2**20  # gradient reductions started in buckets
        self.skip = skip  # layout changes that deadlocked: per-reader messages instead
        self.changes: list[Change] = []
        self.change_tags: dict[tuple, tuple] = {}  # ("recv", src, tag) -> change key
        self.plan = checked.plan
        self.sequences = checked.sequences
        self.replicas = checked.replicas  # plan.scale's replicas: what their unit adds
        self.sources = Sources([op for seq in checked.sequences.values() for op in seq])
        self.position = {op: i for seq in checked.sequences.values() for i, op in enumerate(seq)}
        n = self.plan.ndevices
        self.table = ReadTable(n)
        self.written = Written(n)
        self.names = Names(n, self.plan.graph)
        self.forward_of = {g: t for t, g in self.plan.grads.items()}
        self.tag = 0
        self.stored = [checked.storage.stored[d] for d in range(n)]
        self.owned = [checked.storage.owned[d] for d in range(n)]
        self.runs = [checked.storage.replica_runs(self.plan, d) for d in range(n)]
        self.owners: dict[str, list[tuple[int, Mask]]] = defaultdict(list)
        for rank, owned in enumerate(self.owned):
            for pname, regions in owned.items():
                self.owners[pname] += [(rank, o.region) for o in regions]
        # A template (``plan.micro``): the step each cell piece belongs to (``arrange`` and
        # ``fold`` run the steps once per micro-batch)
        self.cells = cells_of(self.plan) if self.plan.micro > 1 else {}
        self.batched = batch_axes(self.plan.graph) if self.cells else {}
        self.route_of: dict[PlanOp, tuple[int, int] | None] = {}  # see ``routes``
        self.readers: dict[tuple[PTensor, Mask], set[int]] = defaultdict(set)  # see ``lanes``
        for rank, seq in checked.sequences.items():
            for op in seq:
                for v in op.inputs:
                    self.readers[(v.ptensor, v.mask)].add(rank)

    # ---- building ------------------------------------------------------------------------

    def run(self) -> Program:
        """Every piece's reads resolved and written, then the passes (``PASSES``)."""
        self.lower()
        ranks = run_passes(Lowered(self.plan, self.written, self.sequences, self.cells,
                                   self.names, self.bucket_bytes))
        refresh = self.refresh()
        return Program(self.plan, ranks, self.stored, groups_of(ranks, refresh), self.owned,
                       refresh, self.changes, self.runs)

    def lower(self) -> None:
        """Name every piece, then write each piece's reads and call, then each rank's
        tail: the gradients it hands to the regions it owns, the loss, buffers."""
        for rank, seq in sorted(self.sequences.items()):  # name every piece before any read
            for op in seq:
                for v in op.outputs:
                    hint = f"d_{self.forward_of[v.ptensor].name}" \
                        if v.ptensor in self.forward_of else v.ptensor.name
                    var = self.names.fresh(rank, hint, v.mask.shape)
                    self.table.piece[(op, v.mask, v.ptensor)] = var
                    self.names.tensor_of[rank][var] = v.ptensor
                    if self.alike(op, v.mask):
                        self.names.whole[rank].add(var)
        if self.cluster is not None:
            self.layout_changes()
        for rank, seq in sorted(self.sequences.items()):
            for op in seq:
                self.emit(rank, op)
        tail = self.written.tail
        for rank in range(self.plan.ndevices):
            grads = []  # gathered first, handed over after: the sums can then be fused
            for pname in self.plan.graph.params:  # one order on every rank
                param = self.plan.graph.params[pname]
                if param not in self.plan.requires_grad:  # frozen, or a plan's evaluation
                    continue
                for owned in self.owned[rank].get(pname, ()):
                    var = self.read(rank, VTensor(self.plan.grad(param), owned.grad), tail[rank])
                    whole = owned.region.index == owned.grad.index  # no slice to take
                    grads.append(Grad(pname, owned.region, var, () if whole else
                                      Mask(owned.region.index).local_slices(owned.grad)))
            if self.replicas is not None:
                grads = self.over_replicas(rank, grads)
            tail[rank] += grads
        loss = self.plan.graph.loss
        whole_loss = VTensor(loss, Mask.full(loss.shape))
        for rank in self.loss_summers(whole_loss):
            self.read(rank, whole_loss, tail[rank])
        var = self.read(0, whole_loss, tail[0])
        if self.replicas is not None:  # the global loss: the replicas' shares summed
            total = self.names.fresh(0, f"{var}_total", loss.shape)
            tail[0].append(AllReduce((total,), ((var,),), self.replicas.group(0), (loss.shape,),
                                     loss.dtype, (Key(loss.name, (), Role.LOSS, ("replicas",)),)))
            var = total
        tail[0].append(Loss(var))
        for bname, t in self.plan.graph.buffer_updates.items():  # every rank keeps whole buffers
            for rank in range(self.plan.ndevices):
                var = self.read(rank, VTensor(t, Mask.full(t.shape)), tail[rank])
                tail[rank].append(SetBuffer(bname, var))

    def role(self, t: PTensor) -> Role:
        """What a collective of ``t`` sums or moves: a gradient, the loss, or a value."""
        if t in self.forward_of:
            return Role.GRADIENT
        return Role.LOSS if t is self.plan.graph.loss else Role.VALUE

    def loss_summers(self, whole: VTensor) -> list[int]:
        """The ranks that sum the loss with rank 0 rather than send it their parts: all
        that hold a partial value of the whole loss, rank 0 among them (data parallel's
        shares). Their sum is one all-reduce, which ``buckets`` puts in a gradient
        bucket: rank 0 reports the loss without a message of its own."""
        found = self.sources.find(whole, 0)
        holders = {placed(p) for p, _ in found}
        if (0 not in holders or len(holders) < 2 or self.replicas is not None
                or any(m.index != whole.mask.index for _, m in found)):
            return []
        return sorted(holders - {0})

    def over_replicas(self, rank: int, grads: list[Grad]) -> list[Grad]:
        """The gradients ``rank`` hands to its owned regions, summed over its replicas first
        (one all-reduce per dtype, which ``buckets`` cuts up and moves into the backward)."""
        runs = self.runs[rank]
        by_dtype: dict[tuple[torch.dtype, bool], list[int]] = defaultdict(list)
        for i, g in enumerate(grads):
            by_dtype[(self.plan.graph.params[g.param].dtype,
                      (g.param, g.region.index) in runs)].append(i)
        out = list(grads)
        assert self.replicas is not None
        group = self.replicas.group(rank)
        for (dtype, cut), at in by_dtype.items():
            shapes = [self.names.shapes[rank][grads[i].var] for i in at]
            dims = [runs[(grads[i].param, grads[i].region.index)] for i in at] if cut else []
            if cut:  # this replica's run of each
                shapes = [(*s[:d], s[d] // len(group), *s[d + 1:]) for s, d in zip(shapes, dims)]
            summed = [self.names.fresh(rank, f"{grads[i].var}_{'run' if cut else 'total'}", shape)
                      for i, shape in zip(at, shapes)]
            keys = tuple(Key(self.plan.grad(self.plan.graph.params[grads[i].param]).name,
                             grads[i].region.index, Role.GRADIENT, ("replicas",)) for i in at)
            srcs = tuple((grads[i].var,) for i in at)
            self.written.tail[rank].append(
                ReduceScatter(tuple(summed), srcs, group, tuple(shapes), dtype, tuple(dims),
                              keys) if cut else
                AllReduce(tuple(summed), srcs, group, tuple(shapes), dtype, keys))
            for k, (i, var) in enumerate(zip(at, summed)):
                out[i] = replace(grads[i], var=var, run=dims[k] if cut else None)
        return out

    def layout_changes(self) -> None:
        """Searched RVD paths where they beat per-reader messages (see ``layout_changes``)."""
        emitter = Emitter(self.names.fresh, self._next_tag)
        assert self.cluster is not None
        routed = {t for seq in self.sequences.values() for op in seq if self.routes(op)
                  for v in (*op.inputs[:3], *op.outputs)
                  for t in (v.ptensor, self.plan.grads.get(v.ptensor))}
        for change in find_changes(self.sequences, self.cluster, self.skip):
            where = placement(change, self.position, self.sequences)
            if where is None or change.tensor in routed:  # routed rows: messages, see ``rows``
                continue
            start = self.tag
            inputs = {placed(op): self.table.piece[(op, m, change.tensor)]
                      for op, m in change.producers}
            t = change.tensor
            code, held = emitter.emit(change.path, t.name, t.dtype, change.box.shape,
                                      Key(t.name, change.box.index, self.role(t), change.key),
                                      inputs)
            for rank, (when, op) in where.items():
                at = self.written.post if when == "post" else self.written.pre
                at[op].extend(code.get(rank, []))
            for rank, mask in change.readers:
                self.table.local[rank][(change.tensor, mask)] = held[rank]
            for instructions in code.values():
                for ins in instructions:
                    if isinstance(ins, Recv) and ins.tag > start:
                        self.change_tags[("recv", ins.src, ins.tag)] = change.key
            self.changes.append(change)

    def _next_tag(self) -> int:
        self.tag += 1
        return self.tag

    def refresh(self) -> list[list[Instruction]]:
        """After the optimizer step: stored regions that others own, copied from the owners."""
        code: list[list[Instruction]] = [[] for _ in range(self.plan.ndevices)]
        gathers: dict[tuple[int, ...], list[tuple[str, tuple, int]]] = defaultdict(list)
        gathered = set()
        for pname in self.plan.graph.params:  # one order on every rank
            found = self._sharded(pname)
            if found is not None:
                members, region, dim = found
                gathers[members].append((pname, region.index, dim))
                gathered.add(pname)
        for rank, runs in enumerate(self.runs):  # first the runs the replicas updated
            if runs:
                assert self.replicas is not None  # (runs are a scaled plan's)
                code[rank].append(GatherParams(
                    tuple((p, index, dim) for (p, index), dim in runs.items()),
                    self.replicas.group(rank)))
        for members, params in gathers.items():
            for rank in members:
                code[rank].append(GatherParams(tuple(params), members))
        for rank, stored in enumerate(self.stored):
            for pname, regions in stored.items():
                if pname in gathered:
                    continue
                for region in regions:
                    for owner, owned in self._owners(pname, region, rank):
                        if owner == rank:
                            continue
                        self.tag += 1
                        part = owned.intersect(region)
                        assert part is not None  # (owners of the region)
                        code[owner].append(PushParam(pname, owned, part, rank, self.tag))
                        code[rank].append(PullParam(pname, region, part, owner, self.tag,
                                                    self.plan.graph.params[pname].dtype))
        return code

    def _sharded(self, pname: str) -> tuple[tuple[int, ...], Mask, int] | None:
        """Whether ``pname`` is stored whole by exactly its owners, each owning one equal
        run of it along one dim: then the refresh is an all-gather (members in run order)."""
        owners: dict[int, list[Mask]] = defaultdict(list)
        for r, region in self.owners[pname]:
            owners[r].append(region)
        if len(owners) < 2 or any(len(o) != 1 for o in owners.values()):
            return None
        whole = Mask.full(self.plan.graph.params[pname].shape)
        if any(self.stored[r].get(pname) != [whole] for r in owners) or any(
                pname in self.stored[r] for r in range(self.plan.ndevices) if r not in owners):
            return None
        ranks = list(owners)
        found = equal_runs(whole, [owners[r][0] for r in ranks])
        if found is None:
            return None
        dim, order = found
        return tuple(ranks[i] for i in order), whole, dim

    def _owners(self, pname: str, region: Mask, reader: int) -> list[tuple[int, Mask]]:
        """One owner for each owned region overlapping ``region`` (the reader's own first)."""
        found: dict[Mask, int] = {}
        for rank, owned in sorted(self.owners[pname], key=lambda o: o[0] != reader):
            if owned.overlaps(region):
                found.setdefault(owned, rank)
        return [(rank, m) for m, rank in found.items()]

    def emit(self, rank: int, op: PlanOp) -> None:
        pre = self.written.pre[op]
        outs = [self.table.piece[(op, v.mask, v.ptensor)] for v in op.outputs]
        for v, var, copies in zip(op.outputs, outs, op.output_copies()):
            # a part of a value is read from the copy ``Sources.find`` picks for every reader
            if v.mask.value.is_full or not copies:
                self.table.local[rank].setdefault((v.ptensor, v.mask), var)
        if op.weight:  # reads nothing: its input part's call kept what it needs
            self.written.main[op] = WeightGrad(op, tuple(outs))
            return
        ins = tuple(self.read(rank, v, pre, op) for v in op.inputs)
        if op.is_backward:
            self.written.main[op] = Backward((op,), (ins,), (tuple(outs),))
            return
        rg = self.plan.requires_grad
        grad = tuple(v.ptensor in rg for v in op.inputs)
        shares = tuple(self.names.share[rank].get(var, Fraction(1)) for var in ins)
        out_grad = tuple(v.ptensor in rg for v in op.outputs)
        opdef = self.plan.registry.of(op.op.target)
        scale = Fraction(1)
        if opdef is not None and opdef.averages(op.op.args, op.op.kwargs) and op.outputs:
            scale = op.outputs[0].mask.value.width
        scales: tuple[Fraction, ...] = ()
        if self.replicas is not None:
            scale, scales, outs = self.as_replica(rank, op, scale, outs)
        later: tuple[bool, ...] = ()
        if op in self.plan.split and self.plan.weight_op(op) is not None:
            later = tuple(g and v.ptensor.kind is TensorKind.PARAM
                          for v, g in zip(op.inputs, grad))
        self.written.main[op] = Forward(op, ins, tuple(outs), grad, out_grad, scale, shares,
                                        recompute=op in self.plan.recomputed,
                                        swap=op in self.plan.swapped, later=later,
                                        input_scales=scales, fused=self.plan.fused.get(op))

    def as_replica(self, rank: int, op: PlanOp, scale: Fraction, outs: list[str]
                   ) -> tuple[Fraction, tuple[Fraction, ...], list[str]]:
        """A forward piece as one replica runs it (``plan.replicas``): a mean over the batch
        makes its share of the global mean, a loss tail takes its share of the whole values
        it adds, and what sums over the batch without a gradient is summed over the
        replicas as soon as it is made (the piece writes its own part under another name)."""
        rep = self.replicas
        assert rep is not None
        if op.op in rep.means:
            scale *= rep.share
        shared = rep.shares.get(op.op, frozenset())
        scales = tuple(rep.share if j in shared else Fraction(1) for j in range(len(op.inputs))) \
            if shared else ()
        outs = list(outs)
        for k, v in enumerate(op.outputs):
            if v.ptensor in rep.summed:
                mine = self.names.fresh(rank, f"{outs[k]}_mine", v.mask.shape)
                key = Key(v.ptensor.name, v.mask.index, self.role(v.ptensor), ("replicas",))
                self.written.post[op].append(AllReduce((outs[k],), ((mine,),), rep.group(rank),
                                                       (v.mask.shape,), v.ptensor.dtype, (key,)))
                outs[k] = mine
        return scale, scales, outs

    def alike(self, op: PlanOp, mask: Mask) -> bool:
        """Whether every micro-batch of a template makes op's output ``mask`` alike: it is
        a copy at the cut into micro-batches."""
        if not self.plan.templated:
            return False
        k = next(k for k, v in enumerate(op.outputs) if v.mask == mask)
        return any(name in self.plan.templated for name, _ in op.output_copies()[k])

    def read(self, rank: int, v: VTensor, pre: list[Instruction],
             reader: PlanOp | None = None) -> str:
        """The name of a local tensor holding ``v``, adding to ``pre`` what it takes to get
        it; ``reader``: the piece that reads it (None: the tail, after every piece)."""
        key = (v.ptensor, v.mask)
        if key in self.table.local[rank]:
            return self.table.local[rank][key]
        found = self.sources.find(v, rank)
        if not found:
            var = self.load(rank, v, pre)
        else:
            var = self.assemble(rank, v, found, pre, reader)
        self.table.local[rank][key] = var
        self.names.tensor_of[rank].setdefault(var, v.ptensor)
        if found and all(self.alike(op, m) for op, m in found):
            self.names.whole[rank].add(var)
        return var

    def load(self, rank: int, v: VTensor, pre: list[Instruction]) -> str:
        t = v.ptensor
        if t in self.forward_of:
            source = "seed" if self.forward_of[t] is self.plan.graph.loss else "zeros"
        else:
            source = _SOURCES[t.kind]
        held = None
        if source == "param":
            held = next((r for r in self.stored[rank].get(t.name, ())
                         if r.contains(Mask(v.mask.index))), None)
            if held is None:
                return self.fetch_param(rank, v, pre)
        var = self.names.fresh(rank, t.name if source != "seed" else "d_loss", v.mask.shape)
        pre.append(Load(var, t, Mask(v.mask.index), source, held))
        if not v.mask.value.is_full:
            self.names.share[rank][var] = v.mask.value.width
        return var

    def fetch_param(self, rank: int, v: VTensor, pre: list[Instruction]) -> str:
        """A parameter region this rank does not store, from the ranks that own it.

        The owners send at the start of the step, so the reader never waits on an
        owner that is itself waiting.
        """
        t = v.ptensor
        want = Mask(v.mask.index)
        owners = self._owners(t.name, want, rank)
        var = self.gathered(rank, t, want, owners, pre)
        if not v.mask.value.is_full:
            self.names.share[rank][var] = v.mask.value.width
        return var

    def gathered(self, rank: int, t: PTensor, want: Mask, owners: list[tuple[int, Mask]],
                 pre: list[Instruction]) -> str:
        """``want`` of parameter ``t`` from its ``owners``: an all-gather where they hold
        equal runs of it, this rank among them; else each owner's part as a message."""
        pattern = _param_gather(t.name, want, owners, rank)
        if pattern is not None and pattern.key not in self.refused:
            own = next(owned for owner, owned in owners if owner == rank).intersect(want)
            assert own is not None  # (owners of the region)
            local = self.load(rank, VTensor(t, own), pre)
            var = self.names.fresh(rank, t.name, want.shape)
            pre.append(Assemble(var, want.shape, t.dtype, [], replace(pattern, local=(local,))))
            return var
        parts = []
        for owner, owned in owners:
            region = owned.intersect(want)
            assert region is not None  # (owners of the region)
            if owner == rank:
                src = self.load(rank, VTensor(t, region), pre)
            else:
                key = (owner, rank, t.name, region.index)
                if key not in self.table.params:
                    self.tag += 1
                    local = self.load(owner, VTensor(t, region), self.written.head[owner])
                    self.written.head[owner].append(Send(local, (), rank, self.tag))
                    src = self.names.fresh(rank, f"{t.name}_from{owner}", region.shape)
                    pre.append(Recv(src, region.shape, t.dtype, owner, self.tag))
                    self.table.params[key] = src
                src = self.table.params[key]
            parts.append(Part(src, (), region.local_slices(want), Fraction(1)))
        var = self.names.fresh(rank, t.name, want.shape)
        pre.append(Assemble(var, want.shape, t.dtype, parts))
        return var

    def assemble(self, rank: int, v: VTensor, found: list[tuple[PlanOp, Mask]],
                 pre: list[Instruction], reader: PlanOp | None) -> str:
        routed = self.routed(reader, v.ptensor) or any(self.routed(p, v.ptensor) for p, _ in found)
        pattern = None if routed else self.pattern(rank, v, found, pre)  # messages of rows
        if routed and not self.routed(reader, v.ptensor) and \
                (lanes := self.lanes(rank, v, found)) is not None:
            mine, pattern = lanes  # this lane's parts combined, then summed over the lanes
            pattern = replace(pattern, local=(self.summed(rank, v, mine, pre, reader),))
        if pattern is not None and pattern.key not in self.refused:
            # the collective, with no messages
            var = self.names.fresh(rank, v.ptensor.name, v.mask.shape)
            pre.append(Assemble(var, v.mask.shape, v.ptensor.dtype, [], pattern))
            return var
        return self.summed(rank, v, found, pre, reader)

    def summed(self, rank: int, v: VTensor, found: list[tuple[PlanOp, Mask]],
               pre: list[Instruction], reader: PlanOp | None) -> str:
        """A local name for the sum of what ``found`` holds of ``v``, its pieces fetched as
        messages (``fetch``)."""
        found = self.presum(rank, v, found)
        parts = []
        for producer, m in found:
            region = _overlap(m, v.mask)
            value = m.value.intersect(v.mask.value)
            if region is None or value is None:
                continue
            scale = value.width / m.value.width
            src, src_region = self.fetch(rank, producer, m, region, v.ptensor, pre, reader)
            parts.append(Part(src, region.local_slices(src_region), region.local_slices(v.mask),
                              scale))
        if len(parts) == 1 and parts[0].scale == 1 and covers(parts[0].dst_slices, v.mask.shape) \
                and covers(parts[0].src_slices, self.names.shapes[rank][parts[0].src]):
            return parts[0].src  # exactly one whole tensor: no copy
        var = self.names.fresh(rank, v.ptensor.name, v.mask.shape)
        common = {p.scale for p in parts}
        if len(common) == 1 and (share := common.pop()) != 1:
            self.names.share[rank][var] = share  # applied by the reader, see ``self.names.share``
            parts = [Part(p.src, p.src_slices, p.dst_slices, Fraction(1)) for p in parts]
        pre.append(Assemble(var, v.mask.shape, v.ptensor.dtype, parts))
        return var

    def presum(self, rank: int, v: VTensor, found: list[tuple[PlanOp, Mask]],
               ) -> list[tuple[PlanOp, Mask]]:
        """Partial values of one region that another rank made several pieces of are summed
        there, after the last of them, and sent once (a gradient with two readers). Only
        pieces whose values ``v`` takes whole: a piece it takes a share of is scaled alone."""
        t = v.ptensor
        by_rank: dict[tuple[int, tuple], list[tuple[PlanOp, Mask]]] = defaultdict(list)
        for producer, m in found:
            if producer.device != rank and m.value.intersect(v.mask.value) == m.value:
                by_rank[(placed(producer), m.index)].append((producer, m))
        grouped = {id(p) for group in by_rank.values() for p, _ in group}
        out = [(p, m) for p, m in found if id(p) not in grouped]
        for (device, index), group in by_rank.items():
            group.sort(key=lambda pm: pm[1].value.lo)
            joined = all(a.value.hi == b.value.lo for (_, a), (_, b) in zip(group, group[1:]))
            if len(group) < 2 or not joined:
                out += group
                continue
            key = (t, tuple((p.name, m) for p, m in group))
            if key not in self.table.summed:
                last = max((p for p, _ in group), key=lambda p: self.position[p])
                value = ValueRange(group[0][1].value.lo, group[-1][1].value.hi)
                mask = Mask(index, value)
                var = self.names.fresh(device, f"{t.name}_sum", mask.shape)
                self.names.tensor_of[device][var] = t
                whole = tuple(slice(0, n) for n in mask.shape)
                self.written.post[last].append(Assemble(var, mask.shape, t.dtype, [
                    Part(self.table.piece[(p, m, t)], whole, whole, Fraction(1))
                    for p, m in group]))
                self.table.piece[(last, mask, t)] = var
                self.table.summed[key] = (last, mask)
            out.append(self.table.summed[key])
        return out

    def pattern(self, rank: int, v: VTensor, found: list[tuple[PlanOp, Mask]],
                pre: list[Instruction]) -> Pattern | None:
        """What this read does in terms every rank involved can agree on (see ``Pattern``)."""
        devices = [placed(p) for p, _ in found]
        if len(set(devices)) < 2 or rank not in devices or not v.mask.value.is_full \
                or not self.found_alike(v, found, rank, devices):
            return None
        t = v.ptensor
        sources = tuple(sorted((p.name, placed(p)) for p, _ in found))
        local = tuple(self.table.piece[(p, m, t)] for p, m in found if p.device == rank)
        if all(m.index == v.mask.index for _, m in found):
            return Pattern(CollectiveKind.ALL_REDUCE,
                           Key(t.name, v.mask.index, self.role(t), sources),
                           sorted(set(devices)), local)
        masks = [m for _, m in found]
        if all(m.value.is_full for m in masks):
            chunks = equal_runs(v.mask, masks)
            key = Key(t.name, v.mask.index, self.role(t), sources)
            if len(devices) != len(set(devices)):  # members with several runs of it
                held = Counter(devices)
                if chunks is None or len(set(held.values())) != 1:
                    return None
                dim, order = chunks
                slots = tuple(devices[i] for i in order)
                mine = [found[i] for i in order if devices[i] == rank]
                return Pattern(CollectiveKind.ALL_GATHER, key, list(dict.fromkeys(slots)),
                               (self.side_by_side(rank, t, mine, dim, pre),), dim,
                               slots=slots)
            if chunks is not None:
                dim, order = chunks
                return Pattern(CollectiveKind.ALL_GATHER, key, [devices[i] for i in order],
                               local, dim)
            return _all_to_all(key, v.mask, masks, devices, local)
        whole = _partial_sums(masks)
        if whole is None:
            return None
        if whole.index == v.mask.index:
            kind, dim, chunk = CollectiveKind.ALL_REDUCE, 0, 0
        else:
            dims = [d for d, (a, b) in enumerate(zip(v.mask.index, whole.index)) if a != b]
            if len(dims) != 1:
                return None
            dim = dims[0]
            size = v.mask.shape[dim]
            lo, hi = whole.index[dim]
            if (hi - lo) != size * len(set(devices)) or (v.mask.index[dim][0] - lo) % size:
                return None
            kind, chunk = CollectiveKind.REDUCE_SCATTER, (v.mask.index[dim][0] - lo) // size
        if any(m.index != whole.index for p, m in found if p.device == rank):
            local = (self.padded(rank, t, whole, [(p, m) for p, m in found if p.device == rank],
                                 pre),)
        members = sorted(set(devices)) if kind is CollectiveKind.ALL_REDUCE else []
        return Pattern(kind, Key(t.name, whole.index, self.role(t), sources), members, local,
                       dim, chunk)

    def found_alike(self, v: VTensor, found: list[tuple[PlanOp, Mask]], rank: int,
                    devices: list[int]) -> bool:
        """Whether the other members would find the pieces ``rank`` found for ``v``: where
        a region has replicas, each reader takes its own, and the members' keys differ (a
        tied embedding's gradient: each rank's own embedding part, and every rank's
        head part). Only then are the members asked, so plain reads stay cheap."""
        if not self.sources.chosen_per_reader(v.ptensor, found):
            return True
        ours = sorted((p.name, m.index) for p, m in found)
        return all(sorted((p.name, m.index) for p, m in self.sources.find(v, d)) == ours
                   for d in set(devices) - {rank})

    def side_by_side(self, rank: int, t: PTensor, pieces: list[tuple[PlanOp, Mask]], dim: int,
                     pre: list[Instruction]) -> str:
        """This rank's ``pieces`` of ``t`` (equal runs along ``dim``, in order) side by side:
        what it gives a gather where it holds several runs (``Pattern.slots``)."""
        shape = list(pieces[0][1].shape)
        step, shape[dim] = shape[dim], shape[dim] * len(pieces)
        var = self.names.fresh(rank, f"{t.name}_local", tuple(shape))
        self.names.tensor_of[rank][var] = t
        whole = tuple(slice(0, n) for n in pieces[0][1].shape)
        pre.append(Assemble(var, tuple(shape), t.dtype, [
            Part(self.table.piece[(p, m, t)], whole,
                 tuple(slice(k * step, (k + 1) * step) if d == dim else s
                       for d, s in enumerate(whole)), Fraction(1))
            for k, (p, m) in enumerate(pieces)]))
        return var

    def padded(self, rank: int, t: PTensor, whole: Mask, pieces: list[tuple[PlanOp, Mask]],
               pre: list[Instruction]) -> str:
        """This rank's pieces of partial sums added into one partial sum of ``whole`` (zeros
        where it holds none): a weight two readers cut differently, say, has its gradient's
        pieces summed here and then reduced in one collective."""
        var = self.names.fresh(rank, f"{t.name}_local", whole.shape)
        pre.append(Assemble(var, whole.shape, t.dtype, [
            Part(self.table.piece[(p, m, t)], tuple(slice(0, n) for n in m.shape),
                 Mask(m.index).local_slices(whole), Fraction(1)) for p, m in pieces]))
        return var

    def fetch(self, rank: int, producer: PlanOp, m: Mask, region: Mask, t: PTensor,
              pre: list[Instruction], reader: PlanOp | None) -> tuple[str, Mask]:
        """A local name for ``region`` of ``producer``'s piece ``m``, and the region it covers
        (``reader``: as ``read``'s)."""
        src_var = self.table.piece[(producer, m, t)]
        source = placed(producer)
        if source == rank:
            return src_var, Mask(m.index)
        # what a template's step reads of what another rank makes once a step (a table from
        # weights, a mask from the inputs) is received once, before the micro-batches: all
        # of their rows (each step reads its own)
        once = reader in self.cells and producer not in self.cells
        if once and t in self.batched:
            region = self.every_micro_batch(region, t, m)
        key = (producer, m, region.index, t)
        if key not in self.table.received[rank]:
            self.tag += 1
            var = self.names.fresh(rank, f"{t.name}_from{source}", region.shape)
            self.names.tensor_of[rank][var] = t
            # what runs once a step (the tail, or the backward of a piece of no step) reads
            # the sum of every micro-batch's part: sent after they all ran
            after_steps = reader is None or reader.is_backward and reader not in self.cells
            at = self.written.sent_once[source] if after_steps and producer in self.cells \
                else self.written.post[producer]
            sent, got, after = self.rows(rank, producer, reader, t, region == Mask(m.index))
            if after is not None:  # a dispatch: once the routing is made too
                at = self.written.post[max(producer, after, key=self.position.__getitem__)]
            at.append(Send(src_var, region.local_slices(m), rank, self.tag, sent))
            (self.written.received_once[rank] if once else pre).append(
                Recv(var, region.shape, t.dtype, source, self.tag, rows=got))
            self.table.received[rank][key] = var
        return self.table.received[rank][key], Mask(region.index)

    # ---- expert parallelism's dispatch and combine ------------------------------------

    def routes(self, piece: PlanOp) -> tuple[int, int] | None:
        """The experts ``(lo, hi)`` of a piece that runs on the rows routed to them alone,
        sent to it with their routing from the rank that holds its tokens whole; None
        where it runs on whole tokens: it holds every expert, its tokens are its own or
        come in parts, or no exchange is planned for it (``plan.exchanges``) or it was
        refused."""
        if piece not in self.route_of:
            self.route_of[piece] = self._routes(piece)
        return self.route_of[piece]

    def _routes(self, piece: PlanOp) -> tuple[int, int] | None:
        if piece.op.kind != "experts" or piece.is_backward:
            return None
        experts = piece.inputs[3].mask.index[0]
        label = self.exchange(piece)
        if label is None or experts == (0, piece.inputs[3].ptensor.shape[0]) or \
                any(k.via == label.via for k in self.refused):
            return None
        sources = set()
        for v in piece.inputs[:3]:
            found = self.sources.find(v, placed(piece))
            if len(found) != 1 or found[0][1] != v.mask:
                return None
            sources.add(placed(found[0][0]))
        whole = sources.pop()
        if sources or whole == placed(piece) or self.routing(whole, piece) is None:
            return None
        return experts

    def exchange(self, piece: PlanOp) -> Key | None:
        """What names the exchanges an experts piece's tokens take part in (``plan.exchanges``
        holds it or a piece it was cut from), the same on every member."""
        name = piece.name
        while name not in self.plan.exchanges and "." in name:
            name = name.rsplit(".", 1)[0]
        label = self.plan.exchanges.get(name)
        if label is None:
            return None
        return Key(piece.op.name, (), Role.VALUE, ("experts", *label))

    def routing(self, rank: int, piece: PlanOp) -> tuple[str, PlanOp] | None:
        """The local name on ``rank`` of an experts piece's routing index, made there, and
        the piece that makes it."""
        v = piece.inputs[1]
        return next(((self.table.piece[(p, m, v.ptensor)], p)
                     for p, m in self.sources.find(v, rank)
                     if placed(p) == rank and m == v.mask), None)

    def routed(self, piece: PlanOp | None, t: PTensor) -> PlanOp | None:
        """The experts piece that runs ``piece`` (it, or its backward) on routed rows alone,
        where ``t`` is one of its rows tensors: tokens, weights, output, their gradients."""
        if piece is None or piece.weight:
            return None
        forward = piece.forward_op if piece.is_backward else piece
        if self.routes(forward) is None:
            return None
        t = self.forward_of.get(t, t) if piece.is_backward else t
        rows = (forward.inputs[0], forward.inputs[2], *forward.outputs) + \
            (() if piece.is_backward else (forward.inputs[1],))
        return forward if any(v.ptensor is t for v in rows) else None

    def rows(self, rank: int, producer: PlanOp, reader: PlanOp | None, t: PTensor, whole: bool
             ) -> tuple[Rows | None, Rows | None, PlanOp | None]:
        """What a message of ``t`` from ``producer`` to ``rank`` sends and receives: the
        rows a router sent to an experts piece on either side of it, or all of it; and
        where the tokens' side sends them, the piece that makes their routing."""
        experts = self.routed(reader, t)  # the tokens' side sends
        piece = experts or self.routed(producer, t)  # or the experts' side does
        if piece is None:
            return None, None, None
        route = self.routes(piece)
        assert route is not None  # (what ``routed`` found)
        lo, hi = route
        side = placed(producer) if experts else rank
        found = self.routing(side, piece)
        if found is None or not whole:
            raise PlanError(f"{piece.name}: rank {side} exchanges part of the tokens routed "
                            f"to experts {lo}..{hi - 1} without routing them itself: this is "
                            "a bug in chronotope, please report it with the plan")
        index, routing = found
        label = self.exchange(piece)
        assert label is not None  # (a routed piece's)
        key = label.marked((t.name, "dispatch" if experts else "combine"))
        share = reach(piece.inputs[3].ptensor.shape[0], hi - lo, piece.inputs[1].ptensor.shape[-1])
        if experts:
            return (Rows(lo, hi, index, key, share), Rows(lo, hi, None, key, share), routing)
        return Rows(lo, hi, None, key, share), Rows(lo, hi, index, key, share), None

    def lanes(self, rank: int, v: VTensor, found: list[tuple[PlanOp, Mask]]
              ) -> tuple[list[tuple[PlanOp, Mask]], Pattern] | None:
        """Where experts cut along their hidden features (tensor parallelism inside them)
        hand back their parts of ``v`` (what they made, the gradients of their tokens and
        weights), and each member of the group made its part over as many ranks as read
        ``v`` alike: the pieces of this reader's lane, one per member (the combine then
        moves each routed row once per lane, not once per lane and member's rank), and the
        all-reduce over the readers that sums the lanes; the first lane's pieces also hold
        what other ops add to ``v``. None where they do not line up, or that all-reduce was
        refused."""
        readers = sorted(self.readers.get((v.ptensor, v.mask), ()))
        if len(readers) < 2 or rank not in readers:
            return None
        members: dict[tuple[int, int], list[tuple[PlanOp, Mask]]] = defaultdict(list)
        others = []  # what else adds to it (a residual's gradient): the first lane's to add
        for piece, m in found:
            forward = piece.forward_op if piece.is_backward else piece
            if forward.op.kind != "experts":
                others.append((piece, m))
            elif m.index != v.mask.index:
                return None
            else:
                members[forward.inputs[3].mask.index[0]].append((piece, m))  # by its experts
        lane = readers.index(rank)
        mine = [] if lane else others
        for pieces in members.values():
            ranks = sorted(placed(p) for p, _ in pieces)
            if len(ranks) != len(readers) or len(set(ranks)) < len(ranks):
                return None
            mine.append(next((p, m) for p, m in pieces if placed(p) == ranks[lane]))
        key = Key(v.ptensor.name, v.mask.index, self.role(v.ptensor),
                  tuple(("lanes", r) for r in readers))
        if key in self.refused:
            return None
        return mine, Pattern(CollectiveKind.ALL_REDUCE, key, readers, ())

    def every_micro_batch(self, region: Mask, t: PTensor, held: Mask) -> Mask:
        """Micro-batch 0's ``region`` of ``t`` grown along the batch to every micro-batch's
        rows (within the piece ``held`` that holds them all)."""
        a = self.batched[t]
        lo, hi = region.index[a]
        index = list(region.index)
        index[a] = (lo, min(lo + self.plan.micro * (hi - lo), held.index[a][1]))
        return Mask(tuple(index))


def _partial_sums(masks: list[Mask]) -> Mask | None:
    """The region ``masks`` hold partial sums of, when together they are exactly one whole
    value of it (each element's pieces split its value with no gap and no overlap)."""
    whole = Mask(tuple((min(m.index[d][0] for m in masks), max(m.index[d][1] for m in masks))
                       for d in range(masks[0].ndim)))
    shifted = [Mask(tuple((a - lo, b - lo) for (a, b), (lo, _) in zip(m.index, whole.index)),
                    m.value) for m in masks]
    return whole if covers_exactly_once(shifted, whole.shape) else None


def _all_to_all(key: Key, want: Mask, masks: list[Mask], devices: list[int],
                local: tuple[str, ...]) -> Pattern | None:
    """Pieces that are equal runs of a region along one dim, read as equal runs of it
    along another (this reader's among them): an all-to-all."""
    whole = Mask(tuple((min(m.index[d][0] for m in masks), max(m.index[d][1] for m in masks))
                       for d in range(want.ndim)))
    runs = equal_runs(whole, masks)
    if runs is None or len(local) != 1:
        return None
    dim, order = runs
    n = len(masks)
    splits = [d for d, (a, b) in enumerate(zip(want.index, whole.index)) if a != b]
    if len(splits) != 1 or splits[0] == dim:
        return None
    split = splits[0]
    size = want.shape[split]
    lo, hi = whole.index[split]
    if hi - lo != size * n or (want.index[split][0] - lo) % size:
        return None
    return Pattern(CollectiveKind.ALL_TO_ALL,
                   replace(key, region=whole.index, marks=(("split", split),)),
                   [devices[i] for i in order], local, dim, (want.index[split][0] - lo) // size,
                   split)


def _param_gather(name: str, want: Mask, owners: list[tuple[int, Mask]], rank: int,
                  ) -> Pattern | None:
    """A parameter read whole from runs its owners (this rank among them) hold: a gather
    (its ``local`` piece left for the caller to name)."""
    ranks = [r for r, _ in owners]
    found = equal_runs(want, [m for _, m in owners])
    if found is None or rank not in ranks or len(set(ranks)) != len(ranks):
        return None
    dim, order = found
    sources = tuple(sorted((f"update({name})", r) for r in ranks))
    return Pattern(CollectiveKind.ALL_GATHER, Key(name, want.index, Role.VALUE, sources),
                   [ranks[i] for i in order], (), dim)


def materialize(checked: CheckedPlan, cluster: Cluster | None = None,
                bucket_mb: float = BUCKET_MB) -> Program:
    """Every rank's program; with a ``cluster``, layout changes by searched RVD paths
    priced by its cost model where they beat plain messages; gradient reductions in
    buckets of ``bucket_mb`` MiB."""
    skip: frozenset = frozenset()
    refused: frozenset[Key] = frozenset()
    while True:
        m = Lowering(checked, cluster, skip, bucket_mb, refused)
        try:
            return m.run()
        except Refused as e:  # rare: lowered again, those reads as messages
            refused |= e.keys
        except Stuck as e:
            undo = {k.via[:3] if isinstance(k, Key) and k.via[:1] == ("rvd",)  # Change.key
                    else m.change_tags.get(k) for k in e.keys} - {None}
            if not undo:
                raise PlanError(f"the compiled program would wait forever in {e}; this is a "
                                f"bug in chronotope, please report it with the plan") from None
            skip |= undo
