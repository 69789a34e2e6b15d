"""``Plan``: a parallel plan as a program over three primitives on a captured graph.

``trans`` partitions an op into sub-ops, ``assign`` places an op on a device,
``order`` makes one op (or group) run before another on the devices they share.
Backward ops are not written: each forward piece gets one, partitioned and
placed like it, and ``backward(x)`` names them so they can be ordered too.
``split_backward(x)`` cuts a piece's backward in two (zero-bubble schedules): the
input gradients (``backward(x)``), and the weight gradients (``weight(x)``), which
may wait to fill a pipeline's idle time.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from chronotope.errors import PlanError
from chronotope.graph import rng
from chronotope.graph.autocast import DTYPES
from chronotope.graph.ir import (
    NO_GRAD_KINDS,
    Graph,
    Op,
    PTensor,
    TensorKind,
    TensorMeta,
    takes_grad,
)
from chronotope.graph.mask import Mask, ValueRange, VTensor
from chronotope.graph.ops import DEFAULT_REGISTRY
from chronotope.graph.registry import OpRegistry
from chronotope.graph.signature import Signature
from chronotope.graph.trace import user_frame
from chronotope.plan.algo import Algorithm, Piece, ValueSplit, partition
from chronotope.plan.pause import collector_paused

if TYPE_CHECKING:
    from chronotope.plan.check import CheckedPlan
    from chronotope.plan.steps import Step

# Under each op above a piece whose pieces hold the same region of a tensor (copies of it),
# which one the piece descends from: (that op's name, the copy's index), outermost first.
Copies = tuple[tuple[str, int], ...]

@dataclass(frozen=True)
class Fusion:
    """Forward pieces that run as one function compiled by ``torch.compile`` with
    ``backend``: those of one ``group`` that run back to back on a device."""

    group: str
    backend: str


# Kinds whose outputs carry no gradient even when their inputs do.


@dataclass(eq=False)
class PlanOp:
    """One piece of work: a forward (sub-)op, or the backward of a forward piece."""

    name: str
    op: Op
    piece: Piece
    order: int  # position in program order, to break ties between independent ops
    device: int | None = None
    forward: PlanOp | None = None  # set on backward ops
    split: bool = False  # a backward op that is one of the two parts of a split backward
    weight: bool = False  # the part computing the parameters' gradients
    children: list[PlanOp] = field(default_factory=list)
    # The copies of each output (for a backward op: of each gradient it yields) and of
    # each input's gradient this piece is part of (see ``Copies``); empty: none at all.
    copies: tuple[Copies, ...] = ()
    grad_copies: tuple[Copies, ...] = ()
    algo: Algorithm | None = None  # what ``trans`` cut it with, once it has children

    @property
    def is_backward(self) -> bool:
        return self.forward is not None

    @property
    def forward_op(self) -> PlanOp:
        """The forward piece of a backward (or weight-gradient) piece."""
        assert self.forward is not None, f"{self.name} is a forward piece"
        return self.forward

    def output_copies(self) -> tuple[Copies, ...]:
        return self.copies or ((),) * len(self.outputs)

    def input_grad_copies(self) -> tuple[Copies, ...]:
        return self.grad_copies or ((),) * len(self.inputs)

    @property
    def inputs(self) -> tuple[VTensor, ...]:
        return self.piece.inputs

    @property
    def outputs(self) -> tuple[VTensor, ...]:
        return self.piece.outputs

    def __repr__(self) -> str:
        where = "unassigned" if self.device is None else f"device {self.device}"
        return f"PlanOp({self.name}, {where})"


@dataclass(eq=False)
class Group:
    """Ops named together (a layer, a stage x micro-batch), to be placed or ordered at once."""

    name: str
    members: tuple[Ref, ...]

    def __repr__(self) -> str:
        return f"Group({self.name}, {len(self.members)} members)"


@dataclass(eq=False)
class BackwardOf:
    """The backward ops of a forward op or group, whatever it is later cut into; with
    ``weight``, the weight-gradient parts of split ones (``Plan.split_backward``)."""

    of: Ref
    name: str
    weight: bool = False

    def __repr__(self) -> str:
        return f"BackwardOf({self.name})"


# an op, piece, group, backward, op name, or a list of them  (Union: forward references)
Ref = Union[PlanOp, "Group", "BackwardOf", Op, str, Sequence["Ref"]]  # noqa: UP007


@dataclass(frozen=True)
class OrderCall:
    """One ``plan.order(before, after)``, kept so a deadlock can name it."""

    before: Ref
    after: Ref
    where: str

    def __str__(self) -> str:
        return f"plan.order({_label(self.before)}, {_label(self.after)}) at {self.where}"


def _label(ref: Ref) -> str:
    return getattr(ref, "name", str(ref))


class Plan:
    """A plan for ``ndevices`` devices over ``graph``; see the module docstring."""

    def __init__(self, graph: Graph, ndevices: int, *, optimizer: str | float = "adam",
                 dtype: str = "fp32", registry: OpRegistry | None = None) -> None:
        if ndevices < 1:
            raise PlanError(f"a plan needs at least one device, got ndevices={ndevices}")
        self.graph = graph
        self.ndevices = ndevices
        self.optimizer = optimizer
        self.dtype = dtype
        # (data-parallel group, stage, micro-batch) -> its forward pieces, where a pipeline
        # policy made them (for reading the order back as pipeline steps); a stage may be
        # a name, for groups on several ranks (the interlaced pipeline's embedding)
        self.cells: dict[tuple[int, int | str, int], list[PlanOp]] = {}
        self.registry = registry or graph.registry or DEFAULT_REGISTRY
        self.recomputed: set[PlanOp] = set()  # forward pieces run again in their backward
        self.swapped: set[PlanOp] = set()  # forward pieces whose saved tensors wait on the CPU
        self.split: set[PlanOp] = set()  # forward pieces whose weight gradients come apart
        self.fused: dict[PlanOp, Fusion] = {}  # forward pieces run as one compiled function
        self.replicas = 1  # data-parallel copies of this whole plan (see ``scale``)
        self.shard_optimizer = False  # each replica updates 1 / replicas (see ``scale``)
        # A template (see ``template``): the plan is written for the first of ``micro``
        # micro-batches, and ``steps`` say when each device runs each one's (stage, kind).
        self.micro = 1
        self.steps: dict[int, list[Step]] = {}
        self.templated: set[str] = set()  # the ops ``template`` cut: into micro-batches
        # each tensor a template piece holds a micro-batch's run of: that run's length along
        # the axis the cut shortened (a flattened (b t) axis's is samples x tokens, longer
        # than a piece of it the sequence was cut into after)
        self.micro_runs: dict[PTensor, int] = {}
        # Ops a policy was to split along the batch but could not, with why (no signature,
        # or a dim it cannot split): each runs on the whole batch (``policies.mesh``).
        self.unsplit: dict[Op, str] = {}
        self.orders: list[OrderCall] = []
        self.grads: dict[PTensor, PTensor] = {}
        self.requires_grad = differentiable(graph)
        self.roots: dict[str, PlanOp] = {}
        # Optimizer steps made ops (see ``update``), and where parameters are kept:
        # "read": a device stores every region its pieces read, refreshed from the
        # owners after each step (ZeRO 1-2); "owned": only the regions it updates,
        # other regions are fetched from their owners when read (ZeRO 3).
        self.updates: dict[str, PlanOp] = {}
        self.param_storage = "read"
        # With "owned" storage: free what is gathered after its forward and gather it again
        # for its backward (as FSDP2's reshard after forward), where that is safe.
        self.reshard = False
        # The same for activations gathered from other devices for pieces that save them
        # (context parallelism's keys and values): each device keeps only its own runs.
        self.regather = False
        # Keys and values gathered for attention alone land a device at a time, each block
        # attended to as it lands (ring attention, ``compile/ring.py``).
        self.ring = False
        # Expert parallelism: the experts pieces (by name; their pieces too) whose tokens one
        # exchange dispatches to them and combines back, by a label every member shares
        self.exchanges: dict[str, tuple[int, ...]] = {}
        self._by_name: dict[str, PlanOp] = {}
        self._backward: dict[PlanOp, PlanOp | None] = {}
        self._weight: dict[PlanOp, PlanOp | None] = {}
        self._gradient_splits: dict[str, bool] = {}  # see ``_splits_gradient``
        self._readers: dict[PTensor, list[Op]] | None = None
        shares = _gradient_shares(graph, self.requires_grad)
        for i, op in enumerate(graph.ops):
            sizes = op.signature.bind(op.input_shapes,
                                      [t.shape for t in op.outputs]) if op.signature else {}
            masks = [Mask.full(t.shape) for t in op.inputs]
            if op.region is not None:
                masks[0] = Mask(op.region)
            piece = Piece(
                tuple(VTensor(t, m) for t, m in zip(op.inputs, masks)),
                tuple(VTensor(t, Mask.full(t.shape)) for t in op.outputs),
                shares[op], sizes,
            )
            self._add(PlanOp(op.name, op, piece, order=i * 2))
            self.roots[op.name] = self._by_name[op.name]
        self.checked: CheckedPlan | None = None

    # ---- the primitives -------------------------------------------------------------------

    def trans(self, op: Ref, algo: Algorithm) -> list[PlanOp]:
        """Partition a forward op (not yet partitioned) into sub-ops; returns them in order."""
        target = self._one(op, "trans")
        return self._cut(target, algo, self._pieces(target, algo))

    def template(self, op: Ref, algo: Algorithm) -> PlanOp:
        """Cut a forward op as ``trans`` would and keep only the first piece: the plan is
        then written for it alone, and the compiler runs the others from it (micro-batch 0
        of ``micro``: see ``micro_batches``)."""
        target = self._one(op, "template")
        first = self._cut(target, algo, self._pieces(target, algo, count=1))[0]
        self.templated.add(target.name)
        for whole, part in zip((*target.inputs, *target.outputs), (*first.inputs, *first.outputs)):
            for (lo, hi), (a, b) in zip(whole.mask.index, part.mask.index):
                if (a, b) != (lo, hi):
                    self.micro_runs.setdefault(whole.ptensor, b - a)
        return first

    def _pieces(self, target: PlanOp, algo: Algorithm, count: int | None = None
                ) -> list[Piece]:
        if target.is_backward:
            raise PlanError(f"{target.name} is a backward op: partition its forward op instead")
        if target.children:
            raise PlanError(f"{target.name} is already partitioned into "
                            f"{len(target.children)} sub-ops; transform those instead")
        opdef = self.registry.of(target.op.target)
        additive = opdef.additive_inputs if opdef is not None else ()
        linear = opdef.linear_in(len(target.op.inputs)) if opdef is not None else ()
        if isinstance(algo, ValueSplit) and algo.inputs:
            allowed = opdef.value_splits(len(target.op.inputs)) if opdef is not None else []
            if tuple(algo.inputs) not in allowed:
                raise PlanError(f"{target.name} ({target.op.kind}) is not linear in inputs "
                                f"{list(algo.inputs)} together; it may take value shares of "
                                f"{' or '.join(map(str, map(list, allowed))) or 'none'}")
            linear = tuple(algo.inputs)
        return partition(target.name, target.op.signature, target.piece, algo, additive, linear,
                         count)

    def _cut(self, target: PlanOp, algo: Algorithm, pieces: list[Piece]) -> list[PlanOp]:
        """The pieces of ``target``: what was said of it (its device, recompute, swap,
        split backward, fusion) holds for each, whichever primitive came first; a
        backward already made of it gives way to its pieces' own."""
        target.children = []
        target.algo = algo
        for i, p in enumerate(pieces):
            copies, grad_copies = _copies(target, p, i)
            target.children.append(PlanOp(f"{target.name}.{i}", target.op, p, target.order,
                                          target.device, copies=copies,
                                          grad_copies=grad_copies))
        for marks in (self.recomputed, self.swapped, self.split):
            if target in marks:
                marks.discard(target)
                marks.update(target.children)
        if target in self.fused:
            fusion = self.fused.pop(target)
            self.fused.update(dict.fromkeys(target.children, fusion))
        for made in (self._backward.pop(target, None), self._weight.pop(target, None)):
            if made is not None:
                del self._by_name[made.name]
        for child in target.children:
            self._add(child)
        self.checked = None
        return list(target.children)

    def micro_batches(self, micro: int, steps: Mapping[int, Sequence[tuple[str, int, int]]]
                      ) -> None:
        """Make this plan a template: its pieces of the ops the batch flows through are
        micro-batch 0's of ``micro`` (cut with ``template``, grouped by stage in
        ``cells``), and each device runs every micro-batch's forward (F), backward (B)
        and weight-gradient (W) steps of its stages in the order ``steps[device]`` lists
        them as ``(kind, stage, micro-batch)``. Plan, check and compile then cost what one
        micro-batch costs; the compiled program runs them all."""
        from chronotope.plan.steps import Kind, Step  # (steps.py reads plans)

        if micro < 1:
            raise PlanError(f"micro_batches needs micro >= 1, got {micro}")
        kinds = {k.value for k in Kind}
        for d, listed in steps.items():
            wrong = next((s for s in listed if s[0] not in kinds), None)
            if wrong is not None:
                raise PlanError(f"device {d}'s step {tuple(wrong)}: a step's kind is one of "
                                f"{', '.join(sorted(kinds))}")
        self.micro = micro
        self.steps = {d: [Step(Kind(k), s, m) for k, s, m in listed]
                      for d, listed in steps.items()}
        self.checked = None

    def assign(self, op: Ref, device: int) -> None:
        """Place a forward op, group or sub-op (and so its backward) on ``device``."""
        if not isinstance(device, int) or not 0 <= device < self.ndevices:
            raise PlanError(f"cannot assign {_label(op)} to device {device}: this plan has "
                            f"devices 0..{self.ndevices - 1}")
        for leaf in self.leaves(op):
            if leaf.is_backward:
                raise PlanError(f"{leaf.name} is a backward op: it runs where its forward runs")
            leaf.device = device
            for made in (self._backward.get(leaf), self._weight.get(leaf)):
                if made is not None:  # made before this call: it follows its forward
                    made.device = device
        self._set_device(op, device)
        self.checked = None

    def order(self, before: Ref, after: Ref) -> None:
        """On every device both run on, ``before``'s ops run before ``after``'s."""
        frame = user_frame(sys._getframe(1))
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "?"
        for ref in (before, after):
            self.leaves(ref)  # unknown names fail here, where the user wrote them
        self.orders.append(OrderCall(before, after, where))
        self.checked = None

    def update(self, param: str, *, whole_grad: bool = False) -> PlanOp:
        """The optimizer step of parameter ``param``, as an op to partition and place.

        Its pieces own regions of the parameter: the device of a piece keeps that
        region's optimizer state and updates it, reading the region's gradient (or
        the whole gradient with ``whole_grad``, as ZeRO-1 does). Left alone, every
        device that reads a region updates it (data parallel).
        """
        if param in self.updates:
            return self.updates[param]
        t = self.graph.params.get(param)
        if t is None:
            raise PlanError(f"the graph has no parameter {param!r}")
        if t not in self.requires_grad:
            raise PlanError(f"parameter {param!r} gets no gradient, so it has no update")
        dims = [f"d{i}" for i in range(len(t.shape))]
        reads = [f"g{i}^" for i in range(len(t.shape))] if whole_grad else dims
        text = f"{' '.join(reads) or '()'} -> {' '.join(dims) or '()'}"
        grad = self.grad(t)
        signature = Signature.parse(text)
        op = Op(f"update({param})", "update", "update", (grad,), {}, (grad,), (t,), signature)
        piece = Piece((VTensor(grad, Mask.full(t.shape)),), (VTensor(t, Mask.full(t.shape)),),
                      (ValueRange.FULL,), signature.bind([t.shape], [t.shape]))
        root = PlanOp(op.name, op, piece, order=0)
        self._add(root)
        self.updates[param] = root
        self.checked = None
        return root

    def recompute(self, ref: Ref) -> None:
        """Keep none of these forward pieces' activations: their backward runs them again
        first (activation checkpointing). Only their inputs from outside stay alive."""
        self._mark(ref, self.recomputed, "recompute", self.swapped)

    def swap(self, ref: Ref) -> None:
        """Keep what these forward pieces save for their backward in CPU memory: out after
        the forward, back when the backward needs it (activation swap)."""
        self._mark(ref, self.swapped, "swap", self.recomputed)

    def fuse(self, ref: Ref, group: str, backend: str = "inductor") -> None:
        """Run these forward pieces as one function that ``torch.compile`` compiles with
        ``backend`` (its forward and its backward graph): the pieces of ``group`` that run
        one after another on a device with no communication between them. A fused piece
        runs once, in the graph: it is not recomputed, swapped, split or random."""
        for leaf in self.leaves(ref):
            why = ("a backward op: fuse its forward op" if leaf.is_backward else
                   "recomputed" if leaf in self.recomputed else
                   "swapped" if leaf in self.swapped else
                   "split into input and weight gradients" if leaf in self.split else
                   "random (its draws run outside compiled code)"
                   if rng.drawn(leaf.op.target) else None)
            if why:
                raise PlanError(f"{leaf.name} cannot be fused: it is {why}")
            self.fused[leaf] = Fusion(group, backend)
        self.checked = None

    def split_backward(self, ref: Ref) -> None:
        """Cut these forward pieces' backward in two: the input gradients, which the
        previous stage waits for, and the weight gradients (``weight(ref)``), which
        nothing waits for until the optimizer step. Pieces without both kinds of
        gradient keep one backward."""
        for leaf in self.leaves(ref):
            if leaf.is_backward:
                raise PlanError(f"{leaf.name} is a backward op: split its forward op")
            if leaf in self._backward:
                raise PlanError(f"the backward of {leaf.name} is already made (the plan was "
                                "checked or ordered by it): split it before that")
            if leaf in self.fused:
                raise PlanError(f"{leaf.name} is fused: a fused piece's backward is one graph")
            self.split.add(leaf)
        self.checked = None

    def _mark(self, ref: Ref, into: set[PlanOp], what: str, other: set[PlanOp]) -> None:
        for leaf in self.leaves(ref):
            if leaf.is_backward:
                raise PlanError(f"{leaf.name} is a backward op: {what} its forward op")
            if leaf in other:
                raise PlanError(f"{leaf.name} is already recomputed or swapped: choose one")
            if leaf in self.fused:
                raise PlanError(f"{leaf.name} is fused: a fused piece runs once, in its "
                                f"compiled function; {what} the pieces around it instead")
            into.add(leaf)
        self.checked = None

    def group(self, ops: Iterable[Ref], name: str) -> Group:
        return Group(name, tuple(ops))

    def backward(self, ref: Ref) -> BackwardOf:
        """The backward ops of a forward op or group, to order them (1F1B needs it)."""
        return BackwardOf(ref, f"backward({_label(ref)})")

    def weight(self, ref: Ref) -> BackwardOf:
        """The weight-gradient ops of a forward op or group (see ``split_backward``)."""
        return BackwardOf(ref, f"weight({_label(ref)})", weight=True)

    def scale(self, replicas: int, shard_optimizer: bool = False) -> Plan:
        """Run this plan on ``replicas`` device groups, data parallel (a scale unit).

        The plan stays the size of one group: device ``d`` of replica ``r`` is global
        rank ``r * ndevices + d`` and runs what device ``d`` runs, on its own batch.
        With ``shard_optimizer`` (ZeRO-1 over the replicas, as Megatron's distributed
        optimizer), replica ``r`` updates run ``r`` of each region a device updates and
        keeps only its optimizer state: the gradients are reduce-scattered over the
        replicas, the updated runs all-gathered after the step (``storage.replica_runs``
        says which regions; one that no dim of divides by ``replicas`` stays whole).
        """
        if replicas < 1:
            raise PlanError(f"scale needs replicas >= 1, got {replicas}")
        self.replicas = replicas
        self.shard_optimizer = shard_optimizer and replicas > 1
        self.checked = None
        return self

    @property
    def dtype(self) -> str:
        """What the step computes in: "fp32", or "bf16" / "fp16" under autocast with fp32
        master weights and optimizer state. The memory estimate, the simulator and the
        search price it; ``run`` and ``train`` with this plan compute in it."""
        return self._dtype

    @dtype.setter
    def dtype(self, dtype: str) -> None:
        if dtype not in DTYPES:
            raise PlanError(f"unknown plan dtype {dtype!r}: use {', '.join(DTYPES)}")
        self._dtype = dtype
        self.checked = None

    @property
    def world_size(self) -> int:
        return self.ndevices * self.replicas

    def save(self, path: str) -> None:
        """Write this plan's decisions to a plan file (``chronotope.plan.files``), to apply
        again to a freshly captured graph with ``ct.load_plan``."""
        from chronotope.plan.files import save_plan

        save_plan(self, path)

    # ---- resolving names ------------------------------------------------------------------

    def op(self, name: str) -> PlanOp:
        try:
            return self._by_name[name]
        except KeyError:
            raise PlanError(f"the plan has no op named {name!r}") from None

    def leaves(self, ref: Ref) -> list[PlanOp]:
        """The ops a reference stands for now: forward leaves, or their backward ops."""
        if isinstance(ref, str):
            ref = self.op(ref)
        elif isinstance(ref, Op):
            ref = self.op(ref.name)
        if isinstance(ref, PlanOp):
            if ref.children:
                return [leaf for c in ref.children for leaf in self.leaves(c)]
            return [ref]
        if isinstance(ref, Group):
            return [leaf for m in ref.members for leaf in self.leaves(m)]
        if isinstance(ref, BackwardOf):
            part = self.weight_op if ref.weight else self.backward_op
            return [b for f in self.leaves(ref.of) if (b := part(f)) is not None]
        if isinstance(ref, Sequence):
            return [leaf for r in ref for leaf in self.leaves(r)]
        raise PlanError(f"expected an op, sub-op, group or op name, got {ref!r}")

    def forward_leaves(self) -> list[PlanOp]:
        return [leaf for root in self.roots.values() for leaf in self.leaves(root)]

    def backward_op(self, fwd: PlanOp) -> PlanOp | None:
        """The backward of a forward leaf (None when it has no gradient to pass on); for a
        split one, its input-gradient part."""
        if fwd not in self._backward:
            self._make_backward(fwd)
        return self._backward[fwd]

    def weight_op(self, fwd: PlanOp) -> PlanOp | None:
        """The weight-gradient part of a split backward (None when it is not split)."""
        if fwd not in self._weight:
            self._make_backward(fwd)
        return self._weight[fwd]

    def _make_backward(self, fwd: PlanOp) -> None:
        if fwd.is_backward or fwd.children:
            raise PlanError(f"{fwd.name} is not a forward leaf op")
        rg = self.requires_grad
        marks, taken = self._gradient_share(fwd)
        grad_in = tuple(VTensor(self.grad(v.ptensor), Mask(v.mask.index, taken))
                        for v in fwd.outputs if v.ptensor in rg)
        grad_out = [(v.ptensor.kind is TensorKind.PARAM,
                     VTensor(self.grad(v.ptensor), Mask(v.mask.index, taken.of(share))),
                     tuple(m for m in copies if m not in marks))
                    for v, share, copies in zip(fwd.inputs, fwd.piece.grad_shares,
                                                fwd.input_grad_copies()) if v.ptensor in rg]
        parts = [grad_out]
        if fwd in self.split and len({w for w, _, _ in grad_out}) == 2:
            parts = [[g for g in grad_out if g[0] is part] for part in (False, True)]
        # Backward runs after every forward, in reverse program order.
        order = 4 * len(self.graph.ops) - fwd.order
        made = [PlanOp(f"{fwd.name}.{'w' if k else 'bw'}", fwd.op,
                       Piece(grad_in, tuple(g for _, g, _ in outs), (), fwd.piece.sizes),
                       order=order + k, device=fwd.device, forward=fwd, split=len(parts) > 1,
                       weight=k > 0, copies=tuple(c for _, _, c in outs))
                for k, outs in enumerate(parts) if grad_in and outs]
        for op in made:
            self._by_name[op.name] = op
        self._backward[fwd] = made[0] if made else None
        self._weight[fwd] = made[1] if len(made) > 1 else None

    def _gradient_share(self, fwd: PlanOp, through: str | None = None
                        ) -> tuple[frozenset[tuple[str, int]], ValueRange]:
        """The share of its output's gradient a copy runs its backward on, and the copy
        marks that share undoes.

        A copy (a piece every sibling of which computes the same output, such as a position
        embedding under data parallelism) whose gradient arrives as partial sums on the
        siblings' devices anyway, and which passes gradients to parameters only, runs its
        backward on its device's share: backward is linear in the output's gradient, so
        its parameters' gradients become partial sums, summed with every other gradient
        (in the buckets) instead of the output's gradient being summed mid-backward.
        ``through`` stops at that copy level, for deciding it.
        """
        marks, taken = [], ValueRange.FULL
        for mark in self._copy_marks(fwd):
            if mark[0] == through:
                break
            if self._splits_gradient(mark[0]):
                taken = taken.split(len(self.op(mark[0]).children))[mark[1]]
                marks.append(mark)
        return frozenset(marks), taken

    def _copy_marks(self, fwd: PlanOp) -> list[tuple[str, int]]:
        """The copy marks (outermost first) shared by a piece's outputs and the gradients
        it passes on, where it has them and passes gradients to parameters only."""
        rg = self.requires_grad
        outs = [c for v, c in zip(fwd.outputs, fwd.output_copies()) if v.ptensor in rg]
        grads = [c for v, c in zip(fwd.inputs, fwd.input_grad_copies()) if v.ptensor in rg]
        if (not outs or not grads or fwd.device is None
                or any(v.ptensor.kind is not TensorKind.PARAM
                       for v in fwd.inputs if v.ptensor in rg)):
            return []
        common = set(outs[0]).intersection(*outs[1:], *grads)
        return [m for m in outs[0] if m in common]

    def _splits_gradient(self, parent: str) -> bool:
        """Whether the copies ``parent`` was cut into each take a share of the output's
        gradient (see ``_gradient_share``): decided once for all of them, so that their
        shares add up, and only where every copy's share holds what its device's readers
        of the output pass back (nothing moves to make it)."""
        if parent not in self._gradient_splits:
            n = len(self.op(parent).children)
            self._gradient_splits[parent] = all(
                self._holds_local_gradient(leaf, parent, n) for leaf in self.leaves(parent))
        return self._gradient_splits[parent]

    def _holds_local_gradient(self, leaf: PlanOp, parent: str, n: int) -> bool:
        mark = next((m for m in self._copy_marks(leaf) if m[0] == parent), None)
        if mark is None:
            return False
        _, taken = self._gradient_share(leaf, through=parent)
        share = taken.split(n)[mark[1]]
        if self._readers is None:
            self._readers = self.graph.consumers()
        local = [s for v in leaf.outputs if v.ptensor in self.requires_grad
                 for op in self._readers.get(v.ptensor, ()) for reader in self.leaves(op.name)
                 if reader.device == leaf.device
                 for u, s in zip(reader.inputs, reader.piece.grad_shares)
                 if u.ptensor is v.ptensor and Mask(u.mask.index).overlaps(Mask(v.mask.index))]
        return bool(local) and all(share.contains(s) for s in local)

    def grad(self, t: PTensor) -> PTensor:
        """The gradient tensor of ``t``: one per forward tensor, produced piecewise."""
        if t not in self.grads:
            self.grads[t] = PTensor(f"grad({t.name})", TensorMeta(t.shape, t.dtype),
                                    TensorKind.ACTIVATION)
        return self.grads[t]

    def _one(self, ref: Ref, what: str) -> PlanOp:
        if isinstance(ref, str):
            return self.op(ref)
        if isinstance(ref, Op):
            return self.op(ref.name)
        if not isinstance(ref, PlanOp):
            raise PlanError(f"{what} takes one op or sub-op, got {ref!r}")
        return ref

    def _add(self, op: PlanOp) -> None:
        if op.name in self._by_name:
            raise PlanError(f"two plan ops named {op.name!r}")
        self._by_name[op.name] = op

    def _set_device(self, ref: Ref, device: int) -> None:
        """Sub-ops made later inherit the device of what they are cut from."""
        if isinstance(ref, (str, Op)):
            ref = self._one(ref, "assign")
        if isinstance(ref, PlanOp):
            ref.device = device
            for c in ref.children:
                self._set_device(c, device)
        elif isinstance(ref, Group):
            for m in ref.members:
                self._set_device(m, device)

    # ---- check and report -----------------------------------------------------------------

    def evaluation(self) -> Plan:
        """This plan's forward alone, for a validation loss: the same pieces on the same
        devices storing the same parameter regions, with no backward, no gradient sums and
        no optimizer step; a pipeline runs its forwards in its order. Run it with the
        stream out of training (``rng.Stream``) and dropout keeps everything, as under
        ``model.eval()``. A forward that updates buffers (batch norm's running statistics)
        normalizes with the batch's statistics in this graph, unlike ``model.eval()``: it
        is refused."""
        if self.graph.buffer_updates:
            raise PlanError(
                f"{self.graph.name} updates buffers in its forward "
                f"({', '.join(sorted(self.graph.buffer_updates))}): its training graph "
                "normalizes with each batch's statistics, so evaluating it would not give "
                "model.eval()'s loss; evaluate the exported weights on one device instead")
        plan = copy.copy(self)
        plan.requires_grad, plan.grads = set(), {}
        plan._backward, plan._weight = {}, {}
        plan._by_name = {n: op for n, op in self._by_name.items() if not op.is_backward}
        plan.recomputed, plan.swapped, plan.split = set(), set(), set()
        plan.orders = [o for o in self.orders if not any(
            isinstance(ref, BackwardOf) or getattr(ref, "is_backward", False)
            for ref in (o.before, o.after))]
        plan.steps = {d: [s for s in steps if s[0] == "F"] for d, steps in self.steps.items()}
        plan.checked = None
        return plan

    def check(self) -> CheckedPlan:
        """Dependencies, deadlocks, placement and memory; see ``chronotope.plan.check``."""
        from chronotope.plan.check import check

        if self.checked is None:
            with collector_paused():
                self.checked = check(self)
        return self.checked

    def summary(self) -> str:
        return self.check().summary()

    def __str__(self) -> str:
        return self.summary()


def _copies(parent: PlanOp, piece: Piece, i: int) -> tuple[tuple[Copies, ...],
                                                            tuple[Copies, ...]]:
    """Which copies piece ``i`` of ``parent`` is part of, per output and per input's
    gradient. Where it holds the same region of an output as ``parent`` (a replica; an
    output that lacks the split dim), or yields the same share of the same region of an
    input's gradient (a replica; a linear input under ct.ValueSplit; a bias under a
    reduction split), every sibling does too: a reader must sum the pieces of one only."""
    mark = ((parent.name, i),)
    outs = tuple(c + mark if v.mask == whole.mask else c for c, v, whole in
                 zip(parent.output_copies(), piece.outputs, parent.outputs))
    grads = tuple(c + mark if v.mask.index == whole.mask.index and s == whole_share else c
                  for c, v, whole, s, whole_share in
                  zip(parent.input_grad_copies(), piece.inputs, parent.inputs,
                      piece.grad_shares, parent.piece.grad_shares))
    return outs, grads


def placed(op: PlanOp) -> int:
    """The device of a piece known to be placed (every piece of a checked plan is)."""
    assert op.device is not None, f"{op} is not placed"
    return op.device


def differentiable(graph: Graph) -> set[PTensor]:
    """Tensors the loss is differentiated through: trainable parameters (not frozen ones)
    it is computed from, and what is computed from them that the loss is computed from
    (not a detached pass, like recycling's). A parameter the loss is not computed from
    gets no gradient, as in eager PyTorch: no update, no optimizer state."""
    params = set(graph.trainable())
    rg = set(params)
    for op in graph.ops:
        if op.kind in NO_GRAD_KINDS or not any(t in rg for t in op.inputs):
            continue
        rg.update(t for t in op.outputs if takes_grad(t.dtype))
    reaches = {graph.loss}
    for op in reversed(graph.ops):
        if op.kind not in NO_GRAD_KINDS and any(t in reaches for t in op.outputs):
            reaches.update(op.inputs)
    return rg & reaches


def _gradient_shares(graph: Graph, rg: set[PTensor]) -> dict[Op, tuple[ValueRange, ...]]:
    """Each use of a tensor that passes a gradient back contributes an equal share of its
    gradient's value; a use that passes none (in a pass the loss is not differentiated
    through, like recycling's) has no share, so the shares that are made add up to all."""
    def passes(op: Op, t: PTensor) -> bool:
        return t in rg and any(o in rg for o in op.outputs)

    uses: dict[PTensor, int] = {}
    for op in graph.ops:
        for t in op.inputs:
            uses[t] = uses.get(t, 0) + passes(op, t)
    seen: dict[PTensor, int] = {}
    shares = {}
    for op in graph.ops:
        mine = []
        for t in op.inputs:
            k = seen.get(t, 0)
            seen[t] = k + passes(op, t)
            mine.append(ValueRange.part(k, uses[t]) if passes(op, t) else ValueRange.FULL)
        shares[op] = tuple(mine)
    return shares
