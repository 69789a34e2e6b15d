"""D-Rec: a plan by recursive bi-partition, priced by a symbolic cost without hardware
constants (the thesis's Chapters 4 to 6).

The devices, a power of two, are halved ``log2(devices)`` times. In each round every op
takes one 2-way cut of the piece the previous rounds left it: ``Split(dim, 2)`` of a
splittable dim, ``ValueSplit(2)`` where the op is linear in some input, ``Replicate(2)``
only where neither applies. Cuts are made with ``partition`` exactly as ``Plan.trans``
makes them, so a choice is one algorithm per op and mesh axis and ``build`` turns it into
a plan over the mesh ``(2,) * rounds``.

Costs are element counts of one 2-way exchange, as a device receives them (the thesis's
Theorem 4.2.1: the compute is balanced whatever the cut, so only communication tells cuts
apart). With ``E`` a tensor's elements at this round (what the piece being cut holds):

* ``q_c``: an output left as partial sums is all-reduced, ``E/2``;
* ``q_s``: a trainable weight whose gradient is left partial is synchronised, ``E/2``;
* ``q_r``: an edge whose two ends hold a tensor differently is redistributed: nothing
  from a whole tensor (a local slice or value share), ``E/4`` between two slicings or
  from partial sums to a slicing (all-to-all, reduce-scatter: the thesis's
  ``shape(d0)*shape(d1)/4``), ``E/2`` otherwise (all-gather, all-reduce). Where the
  tensor carries a gradient, the gradient's way back is priced alike.

An op's own cost is ``q_m = q_c + gamma * q_s``. Ops are visited by descending compromise
price (how much their second-best cut costs over their best), each taking the cut with
the least ``q_m`` plus ``q_r`` to the ops already decided in this round. An op whose cuts
all cost alike (an elementwise one) comes late and follows its decided neighbours; until
then it passes ``q_r`` through, as if the ops on either side of it were joined.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from chronotope.compile.rvd import PARTIAL, REPLICATE, is_shard
from chronotope.errors import ChronotopeError
from chronotope.graph.ir import Graph, Op
from chronotope.graph.mask import ValueRange
from chronotope.graph.ops import DEFAULT_REGISTRY
from chronotope.graph.registry import OpRegistry
from chronotope.plan.algo import Algorithm, Piece, Replicate, Split, ValueSplit, partition
from chronotope.plan.plan import Plan
from chronotope.search.space import IRREGULAR, _grad_layout, _layout

Choice = dict[Op, tuple[Algorithm, ...]]


class DRecError(ChronotopeError):
    """D-Rec cannot run as asked: a device count that is no power of two, a choice it
    cannot price, or no pipeline that fits."""


@dataclass
class DRec:
    """Each op's 2-way cut per round (outermost mesh axis first), the plan's symbolic
    cost, and each round's share of it."""

    choice: Choice
    cost: float
    rounds: list[float]

    def prefix(self, rounds: int) -> Choice:
        """The plan for ``2**rounds`` devices: the first rounds of this one, which D-Rec
        over fewer devices would have found (the thesis's Algorithm 3, ``L[rounds]``)."""
        if not 0 <= rounds <= len(self.rounds):
            raise DRecError(f"D-Rec ran {len(self.rounds)} rounds; no plan after {rounds}")
        return {op: algos[:rounds] for op, algos in self.choice.items()}

    @property
    def levels(self) -> list[Choice]:
        """``L[i]`` for every ``i``: the plans for 1, 2, 4, ... devices."""
        return [self.prefix(i) for i in range(len(self.rounds) + 1)]


@dataclass(frozen=True)
class _Cut:
    """One 2-way cut of a piece: the layouts its pieces hold (as ``search.space`` reads
    them), the elements the piece held before, and where the next round goes on."""

    algo: Algorithm
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    grads: tuple[str, ...]
    input_elements: tuple[int, ...]
    q_c: float
    q_s: float
    next: Piece

    def q_m(self, gamma: float) -> float:
        return self.q_c + gamma * self.q_s


@dataclass(frozen=True)
class _Edge:
    """Output ``out`` of ``producer`` read as input ``inp`` of ``consumer``."""

    producer: Op
    out: int
    consumer: Op
    inp: int
    grad: bool  # the tensor carries a gradient back


def rounds_for(devices: int) -> int:
    """How many bi-partitions ``devices`` takes."""
    if devices < 1 or devices & (devices - 1):
        raise DRecError(f"D-Rec halves the devices each round, so their count must be a "
                        f"power of two; got {devices}")
    return devices.bit_length() - 1


class _Cutter:
    """The cuts of every op after a prefix of cuts, remembered per kind of op: ops alike
    (repeated layers') are cut once."""

    def __init__(self, graph: Graph, registry: OpRegistry | None) -> None:
        self.registry = registry or graph.registry or DEFAULT_REGISTRY
        plan = Plan(graph, 1, registry=self.registry)
        self.whole = {op: plan.roots[op.name].piece for op in graph.ops}
        self.trainable = set(graph.trainable())
        self.needs_grad = plan.requires_grad
        self.alike = {op: _alike(op) for op in graph.ops}
        self._cuts: dict[tuple, _Cut | None] = {}
        self._options: dict[tuple, list[_Cut]] = {}

    def piece(self, op: Op, prefix: tuple[Algorithm, ...]) -> Piece:
        if not prefix:
            return self.whole[op]
        made = self.cut(op, prefix[:-1], prefix[-1])
        if made is None:
            raise DRecError(f"{op.name}: {prefix[-1]} after {prefix[:-1]} is no 2-way cut "
                            "of it")
        return made.next

    def cut(self, op: Op, prefix: tuple[Algorithm, ...], algo: Algorithm) -> _Cut | None:
        """``algo`` applied after ``prefix``; None where it cannot cut the op."""
        key = (self.alike[op], prefix, algo)
        if key not in self._cuts:
            self._cuts[key] = self._make(op, self.piece(op, prefix), algo)
        return self._cuts[key]

    def options(self, op: Op, prefix: tuple[Algorithm, ...]) -> list[_Cut]:
        """The cuts offered after ``prefix``: splits and value splits, else a replica."""
        key = (self.alike[op], prefix)
        if key not in self._options:
            found = [c for c in (self.cut(op, prefix, a) for a in self._candidates(op, prefix))
                     if c is not None]
            self._options[key] = found or [self.cut(op, prefix, Replicate(2))]
        return self._options[key]

    def _candidates(self, op: Op, prefix: tuple[Algorithm, ...]) -> list[Algorithm]:
        sizes = self.piece(op, prefix).sizes
        splits = op.signature.splittable() if op.signature is not None else []
        out: list[Algorithm] = [Split(d, 2) for d in splits if sizes[d] % 2 == 0]
        return out + ([ValueSplit(2)] if self._linear(op) else [])

    def _linear(self, op: Op) -> tuple[int, ...]:
        opdef = self.registry.of(op.target)
        return opdef.linear_in(len(op.inputs)) if opdef is not None else ()

    def _make(self, op: Op, piece: Piece, algo: Algorithm) -> _Cut | None:
        opdef = self.registry.of(op.target)
        additive = opdef.additive_inputs if opdef is not None else ()
        try:
            pieces = partition(op.name, op.signature, piece, algo, additive, self._linear(op))
        except ChronotopeError:
            return None  # a dim that does not divide, or one this op cannot cut
        if len(pieces) != 2:
            raise DRecError(f"{op.name}: D-Rec prices 2-way cuts only, not {algo}")
        outputs = tuple(_layout([p.outputs[k] for p in pieces], piece.outputs[k].mask)
                        for k in range(len(op.outputs)))
        if IRREGULAR in outputs:
            return None
        inputs = tuple(_layout([p.inputs[k] for p in pieces], piece.inputs[k].mask)
                       for k in range(len(op.inputs)))
        grads = tuple(_grad_layout(lay, [_share(p, k) for p in pieces], _share(piece, k))
                      for k, lay in enumerate(inputs))
        elements = tuple(v.mask.numel for v in piece.inputs)
        q_c = sum(v.mask.numel for v, lay in zip(piece.outputs, outputs) if lay == PARTIAL) / 2
        q_s = sum(n for t, g, n in zip(op.inputs, grads, elements)
                  if g == PARTIAL and t in self.trainable) / 2
        return _Cut(algo, inputs, outputs, grads, elements, q_c, q_s, pieces[0])


def _share(piece: Piece, k: int) -> ValueRange | None:
    """The share of input ``k``'s gradient the piece yields (none where it records none)."""
    return piece.grad_shares[k] if k < len(piece.grad_shares) else None


def _alike(op: Op) -> tuple:
    """What fixes how an op is cut and priced: ops equal in it are cut alike."""
    return (id(op.target), op.kind, str(op.signature), tuple(map(tuple, op.input_shapes)),
            tuple(t.shape for t in op.outputs),
            None if op.region is None else tuple(b - a for a, b in op.region),
            tuple((t.kind, t.frozen, t.dtype) for t in op.inputs))


def _edges(graph: Graph, needs_grad: set) -> list[_Edge]:
    ops = set(graph.ops)
    return [_Edge(t.producer, t.producer.outputs.index(t), op, k, t in needs_grad)
            for op in graph.ops for k, t in enumerate(op.inputs)
            if t.producer is not None and t.producer in ops]


def _move(src: str, dst: str, elements: int) -> float:
    """Elements a device receives to turn a tensor held as ``src`` into ``dst``."""
    if src == dst or src == REPLICATE:
        return 0.0
    if is_shard(dst) and (src == PARTIAL or is_shard(src)):
        return elements / 4
    return elements / 2


def _wanted_grad(output: str) -> str:
    """How the backward of an output held as ``output`` reads its gradient: sliced
    alike, or whole (each replica, and each partial sum, needs all of it)."""
    return output if is_shard(output) else REPLICATE


def _edge_cost(edge: _Edge, producer: _Cut, consumer: _Cut) -> float:
    elements = consumer.input_elements[edge.inp]
    cost = _move(producer.outputs[edge.out], consumer.inputs[edge.inp], elements)
    if edge.grad:
        cost += _move(consumer.grads[edge.inp], _wanted_grad(producer.outputs[edge.out]),
                      elements)
    return cost


def drec(graph: Graph, devices: int, *, gamma: float = 1.0,
         registry: OpRegistry | None = None) -> DRec:
    """Every op's 2-way cut per round over ``devices`` (a power of two), each round
    deciding ops by descending compromise price; ``gamma`` weighs the weights' sync
    (the share of it not hidden behind compute)."""
    pricing = Pricing(graph, gamma=gamma, registry=registry)
    cutter, edges = pricing.cutter, pricing.edges
    around: dict[Op, list[tuple[_Edge, Op]]] = {op: [] for op in graph.ops}
    for e in edges:
        around[e.producer].append((e, e.consumer))
        around[e.consumer].append((e, e.producer))
    choice: Choice = {op: () for op in graph.ops}
    costs = []
    for _ in range(rounds_for(devices)):
        options = {op: cutter.options(op, choice[op]) for op in graph.ops}
        taken = _round(graph.ops, options, around, gamma)
        costs.append(sum(c.q_m(gamma) for c in taken.values()) +
                     sum(_edge_cost(e, taken[e.producer], taken[e.consumer]) for e in edges))
        choice = {op: choice[op] + (taken[op].algo,) for op in graph.ops}
    return DRec(choice, sum(costs), costs)


def _round(ops: list[Op], options: dict[Op, list[_Cut]],
           around: dict[Op, list[tuple[_Edge, Op]]], gamma: float) -> dict[Op, _Cut]:
    """One bi-partition: ops by descending compromise price, each taking its cheapest
    cut given the ops decided before it in this round."""
    order = sorted(ops, key=lambda op: -_compromise(options[op], gamma))
    free = {op for op in ops if len({c.q_m(gamma) for c in options[op]}) == 1}
    taken: dict[Op, _Cut] = {}
    for op in order:
        taken[op] = min(options[op],
                        key=lambda cut, op=op: cut.q_m(gamma) +
                        _Walk(options, around, free, taken).cost(op, cut))
    return taken


class _Walk:
    """The ``q_r`` one cut of an op brings about in this round: on edges to decided ops,
    and beyond ops whose cuts all cost alike (elementwise ones), which would copy it
    (the thesis removes such ops from the graph first, joining their neighbours), for
    up to ``FOLLOW`` ops away. Edges to other undecided ops cost nothing yet."""

    FOLLOW = 8

    def __init__(self, options: dict[Op, list[_Cut]],
                 around: dict[Op, list[tuple[_Edge, Op]]], free: set[Op],
                 taken: dict[Op, _Cut]) -> None:
        self.options, self.around, self.free, self.taken = options, around, free, taken
        self.cuts: dict[Op, _Cut] = {}
        self.priced: set[_Edge] = set()

    def cost(self, op: Op, cut: _Cut) -> float:
        self.cuts[op] = cut
        return self._from(op, self.FOLLOW)

    def _from(self, op: Op, hops: int) -> float:
        total = 0.0
        for edge, other in self.around[op]:
            if edge in self.priced:
                continue
            known = self.taken.get(other) or self.cuts.get(other)
            if known is None and (other not in self.free or hops == 0):
                continue
            self.priced.add(edge)
            if known is not None:
                total += self._edge(edge, op, self.cuts[op], known)
                continue
            copy = min(self.options[other], key=lambda c: self._edge(edge, op, self.cuts[op], c))
            self.cuts[other] = copy
            total += self._edge(edge, op, self.cuts[op], copy) + self._from(other, hops - 1)
        return total

    @staticmethod
    def _edge(edge: _Edge, op: Op, cut: _Cut, other: _Cut) -> float:
        return _edge_cost(edge, cut, other) if edge.producer is op else \
            _edge_cost(edge, other, cut)


def _compromise(cuts: list[_Cut], gamma: float) -> float:
    """What an op gives up by not taking its best cut: second-best ``q_m`` over best."""
    if len(cuts) < 2:
        return 0.0
    best, second = sorted(c.q_m(gamma) for c in cuts)[:2]
    return second - best


def cost_of(graph: Graph, choice: Mapping[Op, Sequence[Algorithm]], *, gamma: float = 1.0,
            registry: OpRegistry | None = None) -> float:
    """The symbolic cost of any per-op choice of 2-way cuts (all of the same length): the
    ops in ``choice`` and the edges between them, round by round."""
    return Pricing(graph, gamma=gamma, registry=registry).cost(choice)


class Pricing:
    """The symbolic cost model over one graph, its cuts remembered between questions
    (for exhaustive checks, which ask many)."""

    def __init__(self, graph: Graph, *, gamma: float = 1.0,
                 registry: OpRegistry | None = None) -> None:
        self.graph, self.gamma = graph, gamma
        self.cutter = _Cutter(graph, registry)
        self.edges = _edges(graph, self.cutter.needs_grad)

    def sequences(self, op: Op, rounds: int) -> list[tuple[Algorithm, ...]]:
        """Every sequence of ``rounds`` cuts D-Rec could give ``op``."""
        found: list[tuple[Algorithm, ...]] = [()]
        for _ in range(rounds):
            found = [seq + (c.algo,) for seq in found for c in self.cutter.options(op, seq)]
        return found

    def cost(self, choice: Mapping[Op, Sequence[Algorithm]]) -> float:
        """The ops' ``q_m`` and the ``q_r`` of edges between them, over every round."""
        bill = self.bill(choice)
        return sum(bill.own.values()) + self.gamma * sum(bill.sync.values()) + \
            sum(cost for _, _, cost in bill.moves)

    def bill(self, choice: Mapping[Op, Sequence[Algorithm]]) -> _Bill:
        """What ``choice`` costs, op by op and edge by edge."""
        lengths = {len(algos) for algos in choice.values()}
        if len(lengths) > 1:
            raise DRecError(f"every op needs as many cuts as the others; got {sorted(lengths)}")
        cuts: dict[Op, list[_Cut]] = {}
        for op, algos in choice.items():
            algos = tuple(algos)
            cuts[op] = [self._cut(op, algos[:r], a) for r, a in enumerate(algos)]
        own = {op: sum(c.q_c for c in made) for op, made in cuts.items()}
        sync = {op: sum(c.q_s for c in made) for op, made in cuts.items()}
        moves = [(e.producer, e.consumer,
                  sum(_edge_cost(e, p, c) for p, c in zip(cuts[e.producer], cuts[e.consumer])))
                 for e in self.edges if e.producer in cuts and e.consumer in cuts]
        return _Bill(own, sync, moves)

    def _cut(self, op: Op, prefix: tuple[Algorithm, ...], algo: Algorithm) -> _Cut:
        made = self.cutter.cut(op, prefix, algo)
        if made is None:
            raise DRecError(f"{op.name}: {algo} after {prefix} is no 2-way cut of it")
        return made


@dataclass
class _Bill:
    """A choice's cost by where it falls: per op, per op's weights, per edge."""

    own: dict[Op, float]  # q_c
    sync: dict[Op, float]  # q_s
    moves: list[tuple[Op, Op, float]]  # producer, consumer, q_r


def tail_factors(sync: Sequence[float], compute: Sequence[float]) -> list[float]:
    """Each op's share of its weights' sync not hidden behind the compute after it (the
    thesis's Algorithm 2); ops listed in reverse backward order, the last to finish its
    backward first, with sync and compute costs in one unit."""
    if len(sync) != len(compute):
        raise DRecError(f"tail factors need one compute cost per sync cost; got {len(sync)} "
                        f"and {len(compute)}")
    factors, overlap = [], 0.0
    for s, c in zip(sync, compute):
        if s - overlap <= 0:
            factors.append(0.0)
            overlap += c - s
        else:
            factors.append((s - overlap) / s)
            overlap = c
    return factors


def bubble_ratio(stages: int, micro: int) -> float:
    """A synchronous pipeline's time over its busy time: ``(stages + micro - 1) / micro``."""
    return (stages + micro - 1) / micro


def balanced_stages(costs: Sequence[float], stages: int) -> list[int]:
    """Each item's stage: consecutive items fill a stage up to an equal share of the total
    (the thesis's Algorithm 5), never more than ``stages`` of them, none left empty while
    items remain for it. Items that cost nothing at all are shared out by count."""
    if stages < 1:
        raise DRecError(f"a pipeline needs at least one stage, got {stages}")
    costs = list(costs) if sum(costs) > 0 else [1.0] * len(costs)
    budget = sum(costs) / stages * (1 + 1e-9)  # rounding must not open a stage early
    out, stage, filled = [], 0, 0.0
    for i, c in enumerate(costs):
        unopened = stages - 1 - stage
        if out and out[-1] == stage and unopened > 0 and \
                (filled + c > budget or len(costs) - i <= unopened):
            stage, filled = stage + 1, 0.0
        out.append(stage)
        filled += c
    return out


@dataclass(frozen=True)
class Pipeline:
    """``stages`` pipeline stages, each op's stage, and each op's cuts within its stage
    (over ``devices / stages`` devices)."""

    stages: int
    stage_of: dict[Op, int]
    choice: Choice
    cost: float


def joint(graph: Graph, devices: int, *, micro: int, compute: Mapping[Op, float],
          fits: Callable[[Pipeline], bool], gamma: float = 1.0,
          found: DRec | None = None, registry: OpRegistry | None = None) -> Pipeline:
    """The cheapest of ``2**i`` pipeline stages, each over ``devices / 2**i`` devices cut as
    D-Rec's plan for that many (the thesis's Algorithm 4), among those ``fits`` accepts.

    A candidate costs ``R_b * max(stage cost) + gamma * max(stage sync)``, its bubble
    ratio ``R_b`` over ``micro`` micro-batches: a stage costs its ops' ``compute`` (an
    op's on one device, in the unit of an element sent: the thesis's ``alpha * q_x / beta``;
    an op not in it: nothing) over the stage's devices, their ``q_c`` and the ``q_r`` of
    edges inside it (between stages: nothing), and its weights sync (``q_s``) once a
    step, alongside the other stages'."""
    found = found or drec(graph, devices, gamma=gamma, registry=registry)
    pricing = Pricing(graph, gamma=gamma, registry=registry)
    total = rounds_for(devices)
    best: Pipeline | None = None
    for i in range(total + 1):
        stages, choice = 2 ** i, found.prefix(total - i)
        if stages > len(graph.ops):
            break  # a stage would be left without ops
        made = _pipeline(pricing, stages, choice, compute, 2 ** (total - i), micro)
        if (best is None or made.cost < best.cost) and fits(made):
            best = made
    if best is None:
        raise DRecError(f"no pipeline of graph {graph.name!r} over {devices} devices fits")
    return best


def _pipeline(pricing: Pricing, stages: int, choice: Choice, compute: Mapping[Op, float],
              width: int, micro: int) -> Pipeline:
    """``stages`` stages over ``width`` devices each, ops split by their whole cost."""
    graph, gamma = pricing.graph, pricing.gamma
    bill = pricing.bill(choice)
    moved = dict.fromkeys(graph.ops, 0.0)
    for _, consumer, cost in bill.moves:
        moved[consumer] += cost
    weight = [compute.get(op, 0.0) / width + bill.own[op] + gamma * bill.sync[op] + moved[op]
              for op in graph.ops]
    stage_of = dict(zip(graph.ops, balanced_stages(weight, stages)))
    busy, sync = [0.0] * stages, [0.0] * stages
    for op in graph.ops:
        busy[stage_of[op]] += compute.get(op, 0.0) / width + bill.own[op]
        sync[stage_of[op]] += bill.sync[op]
    for producer, consumer, cost in bill.moves:
        if stage_of[producer] == stage_of[consumer]:
            busy[stage_of[consumer]] += cost
    cost = bubble_ratio(stages, micro) * max(busy) + gamma * max(sync)
    return Pipeline(stages, stage_of, choice, cost)


__all__ = ["DRec", "DRecError", "Pipeline", "Pricing", "balanced_stages", "bubble_ratio", "cost_of",
           "drec", "joint", "rounds_for", "tail_factors"]
