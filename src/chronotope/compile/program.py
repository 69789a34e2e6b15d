"""The compiled program: per rank, a list of instructions over named local tensors.

Instructions say what a rank does and nothing about how bytes move: ``Send`` /
``Recv`` are point-to-point messages matched by tag, ``Assemble`` builds a
reader's piece from overlapping parts (concatenating regions, summing partial
values), ``Forward`` / ``Backward`` run one plan piece. Codegen turns a rank's
list into a Python module; the runtime executes that module.

A receive or collective with a ``handle`` is only started where it stands: its
results exist from the ``Wait`` on that handle on (see ``compile/overlap.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from fractions import Fraction
from typing import Any, TypeVar

import torch

from chronotope.graph.ir import PTensor
from chronotope.graph.mask import Mask
from chronotope.plan.pause import collector_paused
from chronotope.plan.plan import Fusion, Plan, PlanOp
from chronotope.plan.steps import Cell
from chronotope.plan.storage import Owned, replica_run

Slices = tuple[slice, ...]


class Role(StrEnum):
    """What a collective's output is, which decides how it is summed and when it starts."""

    GRADIENT = "gradient"  # a sum of gradients: in a mixed precision's reduce dtype, bucketed
    LOSS = "loss"  # the loss, summed over a scaled plan's replicas
    VALUE = "value"  # anything else: a forward partial sum, a gather, an exchange, a copy


class CollectiveKind(StrEnum):
    """Which collective a read is one member's share of (``Pattern``)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class Key:
    """What one output of a collective is, the same on every member rank: the members'
    calls are matched by it.

    ``via`` says where the values come from (the producing pieces, as (name, device)
    pairs; a layout change's step; a broadcast's root; a sum over replicas); ``marks``
    tell apart calls over the same pieces (an exchange's split dim, a template's
    micro-batch, a gather run again for the backward)."""

    tensor: str  # the whole tensor's name (a broadcast's: the local name the root sends)
    region: tuple  # its index box
    role: Role
    via: tuple = ()
    marks: tuple = ()

    def marked(self, mark: object) -> Key:
        return replace(self, marks=(*self.marks, mark))


@dataclass
class Load:
    """A leaf piece: a parameter region, a slice of the batch, a constant, the loss seed."""

    var: str
    tensor: PTensor
    mask: Mask
    source: str  # "param", "buffer", "constant", "input", "seed" (ones), "zeros"
    held: Mask | None = None  # for parameters: the region this rank stores, ``mask`` inside it


@dataclass
class Forward:
    op: PlanOp
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    grad: tuple[bool, ...]  # which inputs get a gradient (become autograd leaves)
    out_grad: tuple[bool, ...]  # which outputs pass a gradient back
    output_scale: Fraction = Fraction(1)  # a mean over part of a reduced dim: its share
    input_shares: tuple[Fraction, ...] = ()  # value share of each input this piece takes
    # Inputs that stay connected to their local producer's autograd graph (see autograd_regions.py).
    linked: tuple[bool, ...] = ()
    recompute: bool = False  # run without a graph now, again in its backward
    swap: bool = False  # what it saves for its backward waits in CPU memory
    later: tuple[bool, ...] = ()  # inputs whose gradient a WeightGrad computes (split backward)
    # A scaled plan's share of each input, taken inside autograd: each replica's gradient of
    # the input is its share of the whole's, and the replicas' gradients add up to it.
    input_scales: tuple[Fraction, ...] = ()
    fused: Fusion | None = None  # runs inside one compiled function with its group
    # where its keys and values land from run by run, by input (its keys', its values'):
    # a ring gather's handle and which of its outputs, None where one is not (``ring.py``)
    arriving: tuple[tuple[str, int] | None, ...] = ()

    def leaf(self, i: int) -> bool:
        """Whether input ``i`` enters as an autograd leaf of its own."""
        return self.grad[i] and not (self.linked and self.linked[i])

    def input_grads(self) -> list[int]:
        """The inputs whose gradients its backward call gives (in order): not those a
        ``WeightGrad`` gives later."""
        return [i for i, g in enumerate(self.grad) if g and not (self.later and self.later[i])]


@dataclass
class Backward:
    """One autograd call over backward pieces whose forwards ran on this rank.

    ``grad_outputs[i]`` are the gradients arriving for the outputs of ``ops[i]``'s
    forward that pass one back (None: it flows inside the call); ``outs[i]`` name the
    gradients of its inputs that take one (None: a linked input, nothing leaves).
    """

    ops: tuple[PlanOp, ...]  # backward pieces; ``op.forward`` is what each differentiates
    grad_outputs: tuple[tuple[str | None, ...], ...]
    outs: tuple[tuple[str | None, ...], ...]
    # forward pieces (and the views between them) to run again first, in order
    recompute: tuple[Forward | Assemble, ...] = ()
    # what each of them made that nothing reads any more, freed after it (``with_frees``):
    # the graph keeps what the backward needs, nothing else waits for the call
    frees: tuple[tuple[str, ...], ...] = ()

    def remade_inputs(self) -> tuple[str, ...]:
        """What the steps run again read from outside them (kept alive until here)."""
        made = {v for f in self.recompute for v in writes(f)}
        return tuple(dict.fromkeys(v for f in self.recompute for v in reads(f)
                                   if v not in made))


@dataclass
class WeightGrad:
    """The weight-gradient part of a split backward: what the input part's autograd call
    kept (the gradients at the piece's outputs, its graph) gives its parameters' gradients."""

    op: PlanOp  # the weight-gradient piece; ``op.forward`` is what it differentiates
    outs: tuple[str, ...]


@dataclass(frozen=True)
class Rows:
    """A message of the token rows a router sent to experts ``lo .. hi - 1`` alone (expert
    parallelism's dispatch and combine): tokens routed elsewhere make nothing there.

    The side that holds the tokens whole reads its routing ``index`` (tokens x k experts)
    for which rows those are: it sends them alone, or puts the rows it receives back in
    their places (zeros elsewhere). The experts' side (``index`` None) holds those rows
    alone, side by side, and sends what it holds as it is. Lowering writes such messages
    as sends and receives; the collectives pass makes each ``key``'s an ``Exchange``."""

    lo: int
    hi: int
    index: str | None = None
    key: Key | None = None  # the exchange it is part of, the same on every member
    share: float = 1.0  # of the rows a router that spreads its tokens evenly sends (pricing)


@dataclass
class Send:
    var: str
    slices: Slices
    dst: int
    tag: int
    rows: Rows | None = None


@dataclass
class Recv:
    var: str
    shape: tuple[int, ...]  # routed (``rows``): at most this; the routing decides
    dtype: torch.dtype
    src: int
    tag: int
    handle: str | None = None  # posted here, waited on by ``Wait(handle)``
    rows: Rows | None = None  # routed: part of an exchange (``compile/exchanges.py``)


@dataclass
class Part:
    src: str
    src_slices: Slices  # where the part sits in ``src``
    dst_slices: Slices  # where it goes in the assembled tensor
    scale: Fraction


@dataclass
class Pattern:
    """The collective a read is one member's share of, as lowering recognised it, in terms
    every member agrees on. The ``Assemble`` that carries it has no parts (lowering writes
    no messages for it): the collectives pass writes the collective once every member
    agrees, else it is refused and the read lowered again as messages.

    * ``all_reduce``: each member sums the same region from whole pieces on all of them;
    * ``all_gather``: each member joins the same region from one piece per member, side
      by side along ``dim`` in ``ranks`` order (or where members hold several, in the
      order of ``slots``: the member of each run);
    * ``reduce_scatter``: each member sums its own run ``chunk`` along ``dim`` of a
      region every member holds a partial value of;
    * ``all_to_all``: the members' pieces are equal runs of one region along ``dim``
      (in ``ranks`` order) and each member reads its own run ``chunk`` of that region
      along ``split``: every member sends each other one block.

    ``key`` (tensor, region, producing pieces) is the same on every member; ``local``
    names this rank's own pieces.
    """

    kind: CollectiveKind
    key: Key
    ranks: list[int]
    local: tuple[str, ...]
    dim: int = 0
    chunk: int = 0
    split: int = 0
    slots: tuple[int, ...] = ()


@dataclass
class Assemble:
    """``var`` made of ``parts`` of local tensors: regions side by side, partial values
    summed; with a ``pattern`` (and no parts), a collective to be written."""

    var: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: list[Part]
    pattern: Pattern | None = None
    # a running sum: the first part is a total made by an Assemble that nothing else reads,
    # and the second (whole) part is added into it in place
    accumulate: bool = False

    @property
    def is_view(self) -> bool:
        """Only a box cut out of one local tensor: a view, nothing copied."""
        return len(self.parts) == 1 and self.parts[0].scale == 1 and \
            covers(self.parts[0].dst_slices, self.shape)


@dataclass
class AllReduce:
    """For each output, the sum over ``ranks`` of their local pieces (summed locally first).

    Several outputs travel in one flat buffer, as one collective call.
    """

    vars: tuple[str, ...]
    srcs: tuple[tuple[str, ...], ...]
    ranks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    keys: tuple[Key, ...] = ()  # what each output is, the same on every member rank
    handle: str | None = None


@dataclass
class AllGather:
    """For each output, the members' pieces side by side along its dim, in ``ranks``
    order, on every member. Several outputs travel in one flat buffer, as one call.
    Where members hold several runs of an output (a zigzag of sequence chunks), each
    sends its runs side by side and ``slots`` names the member of each run, in order."""

    vars: tuple[str, ...]
    srcs: tuple[str, ...]
    ranks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]  # of the whole outputs
    dtype: torch.dtype
    dims: tuple[int, ...]
    keys: tuple[Key, ...] = ()
    handle: str | None = None
    slots: tuple[int, ...] = ()
    # steps round a ring (one collective each), each member's piece landing in the outputs
    # as it comes, for readers that take them so (``compile/ring.py``)
    ring: bool = False


@dataclass
class Leave:
    """The gradients of ring attention's keys and values (``AllGather.ring``), summed at
    their owners: ``cp - 1`` steps round the ring, one collective of the group each, where
    each member sends the member ``s`` before it the runs of that member's, started by the
    attention's backward in the call that follows as soon as every piece here gave its
    part of them, so they travel while the backward goes on. Its ``Wait``, after that
    call, gives what came for this rank's runs: per var, the box ``slices`` (of the whole
    gathered tensor) of gather ``0`` (the keys') or ``1`` (the values') from ``srcs``."""

    handle: str | None  # (always one: it is waited on after the backward call)
    gathers: tuple[tuple[str, int] | None, ...]  # the keys' and the values', as ``arriving``
    vars: tuple[str, ...]
    srcs: tuple[int, ...]
    roles: tuple[int, ...]
    slices: tuple[Slices, ...]
    ranks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]  # of the whole gathered tensors (what it moves)
    dtype: torch.dtype
    key: Key  # the keys' gather's, as a gradient: the same on every member


@dataclass
class ReduceScatter:
    """For each output, member ``ranks[i]`` gets run ``i`` along its dim of the sum of the
    members' pieces (each summed locally first). Several outputs travel in one flat
    buffer, as one call."""

    vars: tuple[str, ...]
    srcs: tuple[tuple[str, ...], ...]
    ranks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]  # of the runs this rank gets
    dtype: torch.dtype
    dims: tuple[int, ...]
    keys: tuple[Key, ...] = ()
    handle: str | None = None


@dataclass
class AllToAll:
    """Member ``readers[k]`` gets run ``k`` along ``split`` of what the members hold;
    each member's run arrives from every member and is joined along ``dim`` in
    ``ranks`` order (the order of their pieces)."""

    var: str
    src: str
    ranks: tuple[int, ...]
    readers: tuple[int, ...]
    shape: tuple[int, ...]  # of the run this rank gets
    dtype: torch.dtype
    dim: int
    split: int
    key: Key
    handle: str | None = None


@dataclass
class Exchange:
    """Expert parallelism's dispatch or combine over ``ranks``: the routed rows (``Rows``)
    of one or more tensors this rank ``sends`` each other member and ``recvs`` from each
    (tensor by tensor, members in order), as one all-to-all of uneven sizes (the routing
    decides them), each member's rows of every tensor side by side."""

    sends: tuple[Send, ...]
    recvs: tuple[Recv, ...]
    ranks: tuple[int, ...]
    key: Key
    handle: str | None = None

    @property
    def vars(self) -> tuple[str, ...]:
        return tuple(r.var for r in self.recvs)

    def expected_bytes(self) -> float:
        """The bytes this rank receives, where a router spreads its tokens evenly (the
        routing decides how many come: the shapes are what every row would take)."""
        return sum(math.prod(r.shape) * r.dtype.itemsize * (r.rows.share if r.rows else 1.0)
                   for r in self.recvs)


@dataclass
class Broadcast:
    """``root`` sends ``src[slices]`` to every other member of ``ranks`` at once;
    the others receive it as ``var``."""

    var: str | None  # None on the root
    src: str | None  # None on the receivers
    slices: Slices
    root: int
    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: Key
    handle: str | None = None


@dataclass
class Grad:
    """The summed gradient of one parameter region this rank updates (``var[slices]``);
    with ``run``, of this replica's run of it along that dim (``Plan.scale``'s
    ``shard_optimizer``)."""

    param: str
    region: Mask
    var: str
    slices: Slices = ()
    run: int | None = None


@dataclass
class PushParam:
    """After the optimizer step: send ``region`` of the ``owned`` region this rank updated."""

    param: str
    owned: Mask
    region: Mask
    dst: int
    tag: int


@dataclass
class GatherParams:
    """After the optimizer step: each member updated run ``ranks.index(member)`` along
    ``dim`` of these parameters; one all-gather of all the runs refreshes every copy."""

    params: tuple[tuple[str, tuple, int], ...]  # (name, stored region, dim)
    ranks: tuple[int, ...]


@dataclass
class PullParam:
    """After the optimizer step: receive ``region`` into the ``stored`` region from its owner."""

    param: str
    stored: Mask
    region: Mask
    src: int
    tag: int
    dtype: torch.dtype


@dataclass
class Loss:
    var: str


@dataclass
class SetBuffer:
    """A buffer's value after the step (running statistics), kept for the next step."""

    name: str
    var: str


@dataclass
class Wait:
    """Where what a receive or collective started earlier is first needed: ``vars`` are
    its results (an all-reduce's as a tuple, ``unpack``); with none, where it must have
    finished (a ring gather, after its last reader)."""

    handle: str
    vars: tuple[str, ...]
    unpack: bool = False
    landing: bool = False  # a ring gather's outputs now, its members' pieces still landing


@dataclass
class Free:
    vars: tuple[str, ...]


@dataclass
class Reshard:
    """Free the storage of gathered parameters (and of every view of them) until ``Refill``
    gives it back: what autograd saved of them keeps pointing into it (``reshard.py``)."""

    vars: tuple[str, ...]


@dataclass
class Refill:
    """Give resharded parameters their storage back, filled from the same gather run
    again (``fresh``, output by output)."""

    vars: tuple[str, ...]
    fresh: tuple[str, ...]
    nbytes: int  # what is copied back


@dataclass
class Accumulate:
    """Add ``part`` to the step's running total ``total``, which the runtime keeps (a
    template's sum over its micro-batches: a weight's gradient, the loss), so every
    micro-batch's step runs the same code; the first part is the total as it is."""

    total: str
    part: str
    dtype: torch.dtype  # what the total is summed in


@dataclass
class Total:
    """The running total ``total`` is done: local tensor ``var`` from here on."""

    var: str
    total: str


@dataclass
class Block:
    """Where one step of a template starts (``cell``: its kind and stage), or with None
    where the steps end and what runs once a step goes on (gradients, the loss). Folding
    (``compile/fold.py``) runs each block once per micro-batch, in the steps' order."""

    cell: Cell | None


@dataclass
class Micro:
    """From here on this rank runs micro-batch ``index``'s step of a template (None: what
    runs once a step): the pieces' autograd state is kept per micro-batch."""

    index: int | None
    step: str = ""  # the step it runs, as a pipeline action (``"0F1"``)


Instruction = (Load | Forward | Backward | WeightGrad | Send | Recv | Assemble | AllReduce
               | AllGather | Leave | ReduceScatter | AllToAll | Exchange | Broadcast | Grad
               | Loss | SetBuffer
               | Free | PushParam | PullParam | GatherParams | Wait | Reshard | Refill
               | Accumulate | Total | Block | Micro)
COLLECTIVES = (AllReduce, AllGather, Leave, ReduceScatter, AllToAll, Exchange, Broadcast)
STARTED = (Recv, *COLLECTIVES)  # what may start at one place and be waited on at another
MULTI = (AllReduce, AllGather, ReduceScatter)  # several outputs in one flat call
Collective = AllReduce | AllGather | Leave | ReduceScatter | AllToAll | Exchange | Broadcast
Started = Recv | Collective
Multi = TypeVar("Multi", bound=AllReduce | AllGather | ReduceScatter)
_PER_OUTPUT = ("vars", "srcs", "shapes", "dims", "keys")  # a flat call's fields, by output


def flat(outputs: list[tuple[Multi, int]]) -> Multi:
    """One call of these outputs (an instruction, which of its outputs), all of one kind,
    group and dtype, side by side in one flat buffer."""
    first = outputs[0][0]
    per_output: dict[str, Any] = {f: tuple(getattr(ins, f)[k] for ins, k in outputs)
                                  for f in _PER_OUTPUT if hasattr(first, f)}
    return replace(first, **per_output)


def results(ins: Started) -> tuple[str, ...]:
    """What a receive or collective gives, whether it is waited on at once or later."""
    if isinstance(ins, (*MULTI, Exchange, Leave)):
        return ins.vars
    if isinstance(ins, Broadcast):
        return (ins.var,) if ins.var is not None else ()
    return (ins.var,)


def sums_gradients(keys: tuple[Key, ...]) -> bool:
    """Whether a reduction with these keys sums gradients only (not a forward partial sum
    or a loss's count): they sum in a mixed precision's reduce dtype, and in buckets."""
    return bool(keys) and all(k.role is Role.GRADIENT for k in keys)


def groups_of(*programs: list[list[Instruction]]) -> list[tuple[int, ...]]:
    """The rank sets the collectives of these per-rank codes run over (each rank must make
    every process group before use, in one order)."""
    return sorted({tuple(sorted(ins.ranks)) for ranks in programs for code in ranks
                   for ins in code if isinstance(ins, (*COLLECTIVES, GatherParams))})


def covers(slices: Slices, shape: tuple[int, ...]) -> bool:
    """Whether ``slices`` take all of a tensor of ``shape``."""
    return all(s == slice(0, n) for s, n in zip(slices, shape))


def reads(ins: Instruction) -> tuple[str, ...]:
    """The local tensors an instruction reads."""
    return _READS.get(type(ins), _nothing)(ins)


def _nothing(ins: Any) -> tuple[str, ...]:
    return ()


def _var(ins: Any) -> tuple[str, ...]:
    return (ins.var,)


def _srcs(ins: Any) -> tuple[str, ...]:
    return tuple(v for srcs in ins.srcs for v in srcs)


def _handles(sources: tuple[tuple[str, int] | None, ...]) -> tuple[str, ...]:
    """The ring gathers keys and values land from (``Forward.arriving``)."""
    return tuple(dict.fromkeys(s[0] for s in sources if s is not None))


def _routing(ins: Send | Recv) -> tuple[str, ...]:
    """The routing index a routed message's whole side reads."""
    return (ins.rows.index,) if ins.rows is not None and ins.rows.index is not None else ()


# by type, not a chain of isinstance: the passes ask this of every instruction many times
_READS: dict[type, Callable[[Any], tuple[str, ...]]] = {
    Forward: lambda ins: (*ins.ins, *_handles(ins.arriving)),
    Backward: lambda ins: (*(v for vs in ins.grad_outputs for v in vs if v is not None),
                           *ins.remade_inputs()),
    Assemble: lambda ins: tuple(p.src for p in ins.parts),
    AllReduce: _srcs,
    ReduceScatter: _srcs,
    AllGather: lambda ins: ins.srcs,
    Leave: lambda ins: _handles(ins.gathers),
    AllToAll: lambda ins: (ins.src,),
    Exchange: lambda ins: tuple(v for m in (*ins.sends, *ins.recvs) for v in reads(m)),
    Broadcast: lambda ins: (ins.src,) if ins.src is not None else (),
    Send: lambda ins: (ins.var, *_routing(ins)),
    Recv: _routing,
    Grad: _var, Loss: _var, SetBuffer: _var,
    Accumulate: lambda ins: (ins.part,),
    Wait: lambda ins: (ins.handle,),
    Reshard: lambda ins: ins.vars,
    Refill: lambda ins: (*ins.vars, *ins.fresh),
}


def loads_param(ins: Instruction) -> bool:
    """Whether ``ins`` loads a parameter region this rank stores."""
    return isinstance(ins, Load) and ins.source == "param"


def first_reads(code: list[Instruction]) -> dict[str, int]:
    """Where each local tensor is first read in ``code`` (by index)."""
    first: dict[str, int] = {}
    for i, ins in enumerate(code):
        for var in reads(ins):
            first.setdefault(var, i)
    return first


def writes(ins: Instruction) -> tuple[str, ...]:
    """The local tensors an instruction defines (a started one: its handle)."""
    return _WRITES.get(type(ins), _nothing)(ins)


def _started(ins: Any) -> tuple[str, ...]:
    return (ins.handle,) if ins.handle is not None else results(ins)


_WRITES: dict[type, Callable[[Any], tuple[str, ...]]] = {
    **dict.fromkeys(STARTED, _started),
    Wait: lambda ins: ins.vars,
    Forward: lambda ins: ins.outs,
    Backward: lambda ins: tuple(v for vs in ins.outs for v in vs if v is not None),
    WeightGrad: lambda ins: ins.outs,
    Load: _var, Assemble: _var, Total: _var,
}


@dataclass
class Program:
    """What every rank of a plan runs for one training step."""

    plan: Plan
    ranks: list[list[Instruction]]
    stored: list[dict[str, list[Mask]]] = field(default_factory=list)  # param regions per rank
    groups: list[tuple[int, ...]] = field(default_factory=list)  # rank sets of collectives
    owned: list[dict[str, list[Owned]]] = field(default_factory=list)  # regions each updates
    refresh: list[list[Instruction]] = field(default_factory=list)  # after the optimizer step
    changes: list = field(default_factory=list)  # layout changes by searched RVD paths
    # per rank, the owned regions its replicas update a run each of, and the runs' dim
    runs: list[dict[tuple[str, tuple], int]] = field(default_factory=list)

    @property
    def ndevices(self) -> int:
        return len(self.ranks)

    def updated(self, rank: int) -> list[tuple[str, tuple]]:
        """The regions global rank ``rank`` updates (its optimizer state): its unit
        device's owned regions, or its replica's run of those sharded over the replicas."""
        unit = rank % self.ndevices
        runs = self.runs[unit] if self.runs else {}
        return [(name, replica_run(o.region.index, runs[(name, o.region.index)],
                                   rank // self.ndevices, self.plan.replicas)
                 if (name, o.region.index) in runs else o.region.index)
                for name, owned in self.owned[unit].items() for o in owned]

    def traffic(self, rank: int) -> dict[str, int]:
        """Bytes this rank receives per step, by kind of communication."""
        received = sum(math.prod(i.shape) * i.dtype.itemsize
                       for i in self.ranks[rank] if isinstance(i, Recv))
        received += sum(i.region.numel * i.dtype.itemsize
                        for i in self.refresh[rank] if isinstance(i, PullParam))
        # A ring all-reduce of n bytes over k ranks moves 2 (k - 1) / k * n per rank.
        reduced = sum(2 * (len(i.ranks) - 1) / len(i.ranks) * math.prod(shape) * i.dtype.itemsize
                      for i in self.ranks[rank] if isinstance(i, AllReduce) for shape in i.shapes)
        # An all-gather brings in the (k - 1) pieces of the others; a reduce-scatter as much.
        gathered = sum((len(i.ranks) - 1) / len(i.ranks) * math.prod(shape) * i.dtype.itemsize
                       for i in self.ranks[rank] if isinstance(i, AllGather) for shape in i.shapes)
        scattered = sum((len(i.ranks) - 1) * math.prod(shape) * i.dtype.itemsize
                        for i in self.ranks[rank] if isinstance(i, ReduceScatter)
                        for shape in i.shapes)
        # An all-to-all brings the (k - 1) blocks of this rank's run held by the others.
        exchanged = sum((len(i.ranks) - 1) / len(i.ranks) * math.prod(i.shape) * i.dtype.itemsize
                        for i in self.ranks[rank] if isinstance(i, AllToAll))
        # A routed exchange: the rows a router that spreads its tokens evenly sends
        exchanged += sum(i.expected_bytes() for i in self.ranks[rank] if isinstance(i, Exchange))
        broadcast = sum(math.prod(i.shape) * i.dtype.itemsize
                        for i in self.ranks[rank] if isinstance(i, Broadcast) and i.var)
        params = self.plan.graph.params
        gathered += sum((len(i.ranks) - 1) / len(i.ranks) * math.prod(b - a for a, b in region)
                        * params[name].dtype.itemsize
                        for i in self.refresh[rank] if isinstance(i, GatherParams)
                        for name, region, _ in i.params)
        return {"p2p": received, "all_reduce": int(reduced), "all_gather": int(gathered),
                "reduce_scatter": int(scattered), "all_to_all": int(exchanged),
                "broadcast": broadcast}

    def code(self, rank: int, regions: bool = False) -> str:
        """Rank ``rank``'s step as a readable Python module; with ``regions``, its runs of
        forward pieces as functions for ``torch.compile`` (``compile/compiled_regions.py``)."""
        from chronotope.compile.codegen import render

        with collector_paused():
            return render(self, rank % self.ndevices, regions=regions)
