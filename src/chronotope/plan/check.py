"""Checking a plan: who waits on whom, whether that can ever finish, and what fits where.

Dependencies come from masks: a piece that reads part of a tensor waits for
the pieces that wrote an overlapping part (one replica of each region, the one
on its own device when there is one). With the backward-after-forward edges and
the user's orders they must form a DAG; a cycle is a deadlock and is reported
with the ops on it and the ``order()`` calls that closed it. A topological sort
of the DAG gives each device its complete sequence.
"""

from __future__ import annotations

import heapq
import math
import textwrap
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from chronotope.errors import DeadlockError, PlanError, UnassignedOpError
from chronotope.graph.autocast import Saves, casting, itemsizes, saves
from chronotope.graph.ir import PTensor, TensorKind
from chronotope.graph.mask import BoxIndex, Mask, VTensor
from chronotope.plan.plan import Copies, OrderCall, Plan, PlanOp, differentiable, placed
from chronotope.plan.replicas import Replicas, replicas
from chronotope.plan.steps import cells_of, check_steps, held_at_most
from chronotope.plan.steps import kept as micro_batches_kept
from chronotope.plan.storage import ALLOCATING, Storage, storage, unit

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}


def optimizer_states(optimizer: str | float) -> float:
    """Weight-sized tensors of optimizer state per weight: ``Plan.optimizer``'s count
    (measured from the optimizer a run uses), or that of a name in ``OPTIMIZER_STATES``."""
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool) \
            and optimizer >= 0:
        return optimizer
    states = OPTIMIZER_STATES.get(optimizer) if isinstance(optimizer, str) else None
    if states is None:
        raise PlanError(f"unknown optimizer {optimizer!r}: one of {sorted(OPTIMIZER_STATES)}, "
                        "or how many weight-sized tensors of state it keeps per weight")
    return states


@dataclass(eq=False)
class Barrier:
    """Joins the two sides of one ``order()`` call on one device (keeps edges linear)."""

    call: OrderCall
    device: int
    order: int

    @property
    def name(self) -> str:
        return f"order() at {self.call.where}"


Node = PlanOp | Barrier


@dataclass(frozen=True)
class Edge:
    src: Node
    dst: Node
    why: str


@dataclass(frozen=True)
class Memory:
    """Bytes one device holds: weights, their gradients, optimizer state, and the peak of
    what a step makes (activations, and parameter regions gathered from other devices)."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def __str__(self) -> str:
        b = format_bytes
        return (f"{b(self.total)} = {b(self.params)} params + {b(self.grads)} grads + "
                f"{b(self.optimizer)} optimizer + {b(self.activations)} peak activations")


@dataclass
class CheckedPlan:
    """A plan that passed ``check``: each device's op sequence and memory estimate."""

    plan: Plan
    sequences: dict[int, list[PlanOp]]
    memory: dict[int, Memory]
    edges: list[Edge] = field(repr=False)
    storage: Storage = field(repr=False)
    replicas: Replicas | None = None  # what ``plan.scale``'s replicas change, when scaled

    def sequence(self, rank: int) -> list[PlanOp]:
        """The ops global ``rank`` runs, in order (ranks past the scale unit repeat it)."""
        if not 0 <= rank < self.plan.world_size:
            raise PlanError(f"rank {rank} is out of range for {self.plan.world_size} ranks")
        return self.sequences[rank % self.plan.ndevices]

    def memory_of(self, rank: int) -> Memory:
        self.sequence(rank)
        return self.memory[rank % self.plan.ndevices]

    def summary(self, max_ops: int | None = None) -> str:
        p = self.plan
        ranks = f" x {p.replicas} data-parallel replicas = {p.world_size} ranks" \
            if p.replicas > 1 else ""
        lines = [f"Plan for {p.graph.name}: {p.ndevices} devices{ranks}, "
                 f"{sum(len(s) for s in self.sequences.values())} ops"]
        for d, seq in self.sequences.items():
            lines.append(f"device {d}: {len(seq)} ops, memory {self.memory[d]}")
            names = [op.name for op in seq[:max_ops]]
            if max_ops is not None and len(seq) > max_ops:
                names.append(f"... {len(seq) - max_ops} more")
            lines += textwrap.wrap(", ".join(names), 100, initial_indent="  ",
                                   subsequent_indent="  ")
        return "\n".join(lines)


def check(plan: Plan) -> CheckedPlan:
    forward = plan.forward_leaves()
    unassigned = [op for op in forward if op.device is None]
    if unassigned:
        raise UnassignedOpError(_unassigned_message(unassigned))
    # the training step's gradients say what stays partial over replicas, in its evaluation too
    scaled = replicas(plan.graph, plan.registry, differentiable(plan.graph), plan.replicas,
                      plan.ndevices) if plan.replicas > 1 else None
    backward = {f: b for f in forward if (b := plan.backward_op(f)) is not None}
    weight = {f: w for f in forward if (w := plan.weight_op(f)) is not None}
    ops: list[PlanOp] = forward + list(backward.values()) + list(weight.values())
    edges = data_edges(ops)
    edges += [Edge(f, b, "its backward") for f, b in backward.items()]
    # a weight part uses what its input part's autograd call kept
    edges += [Edge(backward[f], w, "its input gradients") for f, w in weight.items()]
    barriers, order_edges = _order_edges(plan)
    edges += order_edges
    order = _topological(ops + barriers, edges)
    sequences: dict[int, list[PlanOp]] = {d: [] for d in range(plan.ndevices)}
    for node in order:
        if isinstance(node, PlanOp):
            sequences[placed(node)].append(node)
    stored = storage(plan, sequences)
    held = Held(plan)
    # a template: as many micro-batches' activations as a device keeps at once
    cells = cells_of(plan) if plan.micro > 1 else {}
    if cells:
        check_steps(plan, edges, cells)
    memory = {d: estimate_memory(plan, seq, stored, d, held, cells)
              for d, seq in sequences.items()}
    return CheckedPlan(plan, sequences, memory, edges, stored, scaled)


class Sources:
    """Which pieces produced which regions of each tensor, to find what a reader needs."""

    def __init__(self, ops: list[PlanOp]) -> None:
        self.by_tensor: dict[PTensor, dict[tuple, list[tuple[PlanOp, Mask]]]] = defaultdict(dict)
        self.copies: dict[tuple[PlanOp, Mask, PTensor], Copies] = {}
        self.boxes: dict[PTensor, BoxIndex] = {}
        self.overlaps: dict[tuple[PTensor, Mask], list[tuple[PlanOp, Mask]]] = {}
        self.replicated: dict[tuple[PTensor, tuple], set[Mask]] = {}  # see chosen_per_reader
        for op in ops:
            for v, copies in zip(op.outputs, op.output_copies()):
                self.by_tensor[v.ptensor].setdefault(v.mask.index, []).append((op, v.mask))
                if copies:
                    self.copies[(op, v.mask, v.ptensor)] = copies

    def find(self, v: VTensor, device: int | None) -> list[tuple[PlanOp, Mask]]:
        """Pieces overlapping ``v``: one replica per region, on ``device`` when possible.

        Empty for graph inputs, parameters and the loss's seed gradient.
        """
        by_index = self.by_tensor.get(v.ptensor)
        if not by_index:
            return []

        def overlapping() -> list[tuple[PlanOp, Mask]]:
            key = (v.ptensor, v.mask)  # readers of one region (a tp group's) ask alike
            if key not in self.overlaps:  # replicas share an index: find indices, then values
                boxes = self.boxes.get(v.ptensor)
                if boxes is None:
                    boxes = self.boxes[v.ptensor] = BoxIndex(list(by_index))
                value = v.mask.value
                self.overlaps[key] = [
                    (p, m) for k in boxes.overlapping(v.mask.index)
                    for p, m in by_index[boxes.indices[k]] if m.value.intersect(value) is not None]
            return self.overlaps[key]

        t, part = v.ptensor, not v.mask.value.is_full
        if part and any((p, m, t) in self.copies for p, m in overlapping()):
            # Readers of parts of a value take them all from one copy where its pieces are
            # partial sums: their shares must add up to the whole value.
            first = self.one_copy(t, overlapping(), None)
            if any(not m.value.is_full for _, m in first):
                return _one_per_region(first, device)
        found = _exact(by_index.get(v.mask.index, []), v.mask)
        chosen = _one_per_region(overlapping() if found is None else found, device)
        copied = [m for p, m in chosen if (p, m, t) in self.copies]
        # Copies agree on whole values only: partial sums of one copy do not add up with
        # another's (one summed columns, the other rows), nor do overlapping regions.
        if copied and (any(not m.value.is_full for m in copied)
                       or _overlapping([m for _, m in chosen])):
            return _one_per_region(self.one_copy(t, overlapping(), None if part else device),
                                   device)
        return chosen

    def chosen_per_reader(self, t: PTensor, found: list[tuple[PlanOp, Mask]]) -> bool:
        """Whether which of ``found`` a reader gets depends on the reader: a region with
        replicas (each reader takes its own) or a piece of one of several copies."""
        for p, m in found:
            if (p, m, t) in self.copies:
                return True
            key = (t, m.index)
            if key not in self.replicated:
                counts = Counter(x for _, x in self.by_tensor[t][m.index])
                self.replicated[key] = {x for x, n in counts.items() if n > 1}
            if m in self.replicated[key]:
                return True
        return False

    def one_copy(self, t: PTensor, found: list[tuple[PlanOp, Mask]], device: int | None,
                 ) -> list[tuple[PlanOp, Mask]]:
        """The pieces of one copy wherever pieces are copies of each other (the copy with
        the most pieces on ``device``; else the copy at the position ``device``'s own copy
        holds among as many, so that readers of the same position read from one another
        alone; else the first): copies cut differently have regions that overlap without
        being equal, and pieces of two copies would count a value twice."""
        def copies(p: PlanOp, m: Mask) -> Copies:
            return self.copies.get((p, m, t), ())

        kept, chosen = list(found), dict[str, int]()
        aligned: dict[int, int] = {}  # copies of a node -> the position device's own holds
        own_first = sorted(found, key=lambda pm: pm[0].device != device)
        while True:
            node = next((n for p, m in own_first for n, _ in copies(p, m)
                         if n not in chosen and all(chosen.get(k, j) == j
                                                    for k, j in copies(p, m))), None)
            if node is None:
                return kept
            local: dict[int, int] = defaultdict(int)
            for p, m in kept:
                for i in (i for n, i in copies(p, m) if n == node):
                    local[i] += p.device == device
            order = sorted(local)
            best = max(order, key=local.__getitem__)
            if local[best]:
                aligned.setdefault(len(order), order.index(best))
            elif len(order) in aligned:
                best = order[aligned[len(order)]]
            chosen[node] = best
            kept = [(p, m) for p, m in kept
                    if all(chosen.get(n, i) == i for n, i in copies(p, m))]


def _one_per_region(found: list[tuple[PlanOp, Mask]], device: int | None,
                    ) -> list[tuple[PlanOp, Mask]]:
    """One replica of each region: on ``device`` when there is one; else, where ``device``
    holds the ``k``-th replica of a region as many devices hold, the ``k``-th of this one
    too (so that the readers holding the ``k``-th replicas read from one another alone:
    one collective among them); else the one at ``device``'s rank modulo their number (the
    readers spread over the replicas, and a tensor-parallel lane reads from its own lane
    of another group); else the first by name, whatever order ``found`` came in.
    The checker and the compiler must pick the same."""
    regions: dict[Mask, list[PlanOp]] = {}
    for p, m in found:
        regions.setdefault(m, []).append(p)
    rank: dict[int, int] = {}  # replicas per region -> the position of device's own
    for ps in regions.values():
        devices = sorted(map(placed, ps))
        if device in devices and len(set(devices)) == len(devices):
            rank.setdefault(len(devices), devices.index(device))
    out = []
    for m, ps in regions.items():
        local = [p for p in ps if p.device == device]
        if local:
            out.append((min(local, key=lambda p: p.name), m))
        elif len({p.device for p in ps}) == len(ps) and device is not None:
            at = rank.get(len(ps), device % len(ps))
            out.append((sorted(ps, key=placed)[at], m))
        else:
            out.append((min(ps, key=lambda p: p.name), m))
    return out


def _overlapping(masks: list[Mask]) -> bool:
    return any(a.overlaps(b) for i, a in enumerate(masks) for b in masks[i + 1:])


def data_edges(ops: list[PlanOp]) -> list[Edge]:
    """Producer -> consumer for every overlapping piece, one replica per region."""
    sources = Sources(ops)
    return [Edge(p, op, f"reads {v.ptensor.name}")
            for op in ops for v in op.inputs
            for p, _ in sources.find(v, op.device) if p is not op]


def _exact(candidates: list[tuple[PlanOp, Mask]], want: Mask) -> list | None:
    """Producers of exactly the wanted region, if their values cover the wanted value."""
    hits = [(p, m) for p, m in candidates if m.value.intersect(want.value) is not None]
    if any(m.value.is_full for _, m in hits):
        return hits
    covered = sorted({(m.value.lo, m.value.hi) for _, m in hits})
    lo = want.value.lo
    for a, b in covered:
        if a > lo:
            break
        lo = max(lo, b)
    return hits if lo >= want.value.hi else None


def _order_edges(plan: Plan) -> tuple[list[Barrier], list[Edge]]:
    barriers, edges = [], []
    for call in plan.orders:
        before, after = plan.leaves(call.before), plan.leaves(call.after)
        devices = sorted({placed(op) for op in before} & {placed(op) for op in after})
        if not devices:
            raise PlanError(
                f"{call}: the two sides share no device ({_devices(before)} vs "
                f"{_devices(after)}); order() only orders ops on the same device"
            )
        for d in devices:
            rank = min([op.order for op in after if op.device == d])
            barrier = Barrier(call, d, rank)
            barriers.append(barrier)
            edges += [Edge(op, barrier, "order") for op in before if op.device == d]
            edges += [Edge(barrier, op, "order") for op in after if op.device == d]
    return barriers, edges


def _devices(ops: list[PlanOp]) -> str:
    ds = sorted({op.device for op in ops if op.device is not None})
    return "devices " + ", ".join(map(str, ds)) if ds else "no device"


def _topological(nodes: list[Node], edges: list[Edge]) -> list[Node]:
    """Kahn's algorithm, program order first among ready ops; a leftover is a deadlock."""
    index = {id(n): i for i, n in enumerate(nodes)}
    out: dict[int, list[Edge]] = defaultdict(list)
    indegree = [0] * len(nodes)
    for e in edges:
        out[index[id(e.src)]].append(e)
        indegree[index[id(e.dst)]] += 1
    ready = [(n.order, i) for i, n in enumerate(nodes) if indegree[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(nodes[i])
        for e in out[i]:
            j = index[id(e.dst)]
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, (nodes[j].order, j))
    if len(order) < len(nodes):
        stuck = {i for i in range(len(nodes)) if indegree[i] > 0}
        raise DeadlockError(_cycle_message(_find_cycle(stuck, out, index)))
    return order


def _find_cycle(stuck: set[int], out: dict[int, list[Edge]], index: dict) -> list[Edge]:
    """One cycle among the ops Kahn's algorithm could not schedule.

    Every stuck op waits on a stuck predecessor, so walking predecessors must
    come back to an op already seen.
    """
    waits_on: dict[int, Edge] = {}
    for i in stuck:
        for e in out[i]:
            j = index[id(e.dst)]
            if j in stuck:
                waits_on.setdefault(j, e)
    i = min(stuck)
    seen: dict[int, int] = {}
    path: list[Edge] = []
    while i not in seen:
        seen[i] = len(path)
        e = waits_on[i]
        path.append(e)
        i = index[id(e.src)]
    return path[seen[i]:][::-1]


def _cycle_message(cycle: list[Edge]) -> str:
    lines = ["the plan deadlocks: these ops wait on each other in a cycle"]
    calls: list[OrderCall] = []
    for e in cycle:
        if isinstance(e.src, Barrier):
            continue  # shown as the "order" edge that enters it
        dst, why = e.dst, e.why
        if isinstance(dst, Barrier):
            calls.append(dst.call)
            why = f"ordered by plan.order at {dst.call.where}"
            dst = next(x for x in cycle if x.src is dst).dst
        lines.append(f"  {_node(e.src)}  -> must run before ({why}) ->  {_node(dst)}")
    if calls:
        lines.append("order() calls that close the cycle:")
        lines += [f"  {c}" for c in dict.fromkeys(calls)]
    lines.append("Remove or reverse one of these orders, or move one of the ops to another "
                 "device.")
    return "\n".join(lines)


def _node(op: Node) -> str:
    src = f", {op.op.source.file.rsplit('/', 1)[-1]}:{op.op.source.line}" \
        if isinstance(op, PlanOp) and op.op.source else ""
    return f"{op.name} [device {op.device}{src}]"


def _unassigned_message(ops: list[PlanOp]) -> str:
    shown = ", ".join(op.name for op in ops[:12])
    more = f" and {len(ops) - 12} more" if len(ops) > 12 else ""
    return (f"{len(ops)} ops are not assigned to a device: {shown}{more}. "
            "Place each with plan.assign(op, device) (or assign a group or the op they "
            "were cut from).")


# ---- memory --------------------------------------------------------------------------------


class Held:
    """How the plan's dtype holds each tensor (``graph/autocast.py``): its bytes per element
    as autocast makes it (a linear's output in 16 bits, a norm's in 32) and a gradient as
    its tensor; the ops that keep a 16-bit copy of the weights they read for their
    backward; and what autograd keeps of each op (``Saves``)."""

    def __init__(self, plan: Plan) -> None:
        self.sizes: dict[PTensor, int] = {}
        self.casting = casting(plan.graph, plan.dtype)
        self.saves = saves(plan.graph, plan.dtype)
        if plan.dtype != "fp32":
            self.sizes = itemsizes(plan.graph, plan.dtype)
            self.sizes.update({g: self.sizes[t] for t, g in plan.grads.items()
                               if t in self.sizes})

    def nbytes(self, v: VTensor) -> int:
        return v.mask.numel * self.sizes.get(v.ptensor, v.ptensor.dtype.itemsize)

    def copy(self, op: PlanOp, v: VTensor) -> int:
        """The 16-bit copy of weight region ``v`` that ``op`` (or its forward) keeps, if any."""
        return v.mask.numel * 2 if (op.forward or op).op in self.casting else 0

    def of(self, op: PlanOp) -> Saves | None:
        """What autograd keeps of forward piece ``op``; None where not known."""
        found = self.saves.get(op.op)
        if found is None or len(op.inputs) != len(op.op.inputs) \
                or len(op.outputs) != len(op.op.outputs):
            return None
        return found

    def other(self, op: PlanOp) -> int:
        """Bytes forward piece ``op`` keeps besides its inputs and outputs: statistics and
        masks (its share of the whole op's), and 16-bit copies of the activations it read."""
        found = self.of(op)
        if found is None:
            return 0
        return int(found.other * _share(op)) + sum(
            2 * op.inputs[j].mask.numel for j in found.cast
            if op.inputs[j].ptensor.kind is not TensorKind.PARAM)

    def swapped(self, op: PlanOp) -> int:
        """Bytes forward piece ``op`` keeps for its backward, which swapping it moves to
        host memory after it runs and back before its backward."""
        kept = self.of(op)
        return 0 if kept is None else self.other(op) + sum(
            self.nbytes(v) for v in _saved(op, kept))

    def temp(self, op: PlanOp) -> int:
        """Bytes piece ``op`` (a forward or a backward) makes and frees while it runs."""
        found = self.of(op.forward or op)
        if found is None:
            return 0
        made = found.backward_temp if op.is_backward else found.forward_temp
        return int(made * _share(op.forward or op))


def _share(op: PlanOp) -> float:
    """The part of its whole op a forward piece covers: of the op's largest tensor (a
    loss's logits, not its scalar)."""
    whole, piece = max(((math.prod(t.shape), v.mask.numel) for t, v in
                        zip((*op.op.inputs, *op.op.outputs), (*op.inputs, *op.outputs))),
                       default=(1, 1))
    return piece / max(whole, 1)


class _Remade:
    """What recompute makes again in the backward: the recomputed pieces, and their outputs
    (any region of one)."""

    def __init__(self, plan: Plan) -> None:
        self.ops = {(op.device, op) for op in plan.recomputed}
        self.regions: dict[tuple, list[Mask]] = defaultdict(list)
        for op in plan.recomputed:
            for v in op.outputs:
                self.regions[(op.device, v.ptensor)].append(Mask(v.mask.index))

    def op(self, op: PlanOp) -> bool:
        return (op.device, op) in self.ops

    def tensor(self, device: int | None, v: VTensor) -> bool:
        within = Mask(v.mask.index)
        return any(m.contains(within) for m in self.regions.get((device, v.ptensor), ()))


def _saved(forward: PlanOp, kept: Saves) -> tuple[VTensor, ...]:
    """The inputs and outputs of ``forward`` that autograd keeps for its backward."""
    return (*(forward.inputs[j] for j in sorted(kept.inputs)),
            *(forward.outputs[j] for j in sorted(kept.outputs)))


def _recomputed_at(seq: list[PlanOp], remade: _Remade) -> dict[int, int]:
    """For each backward piece of a recomputed forward, where its forward runs again: at
    the first of the run of such pieces of one unit (a layer) it is in, as one backward
    call recomputes them all."""
    out: dict[int, int] = {}
    start, at = None, None
    for i, op in enumerate(seq):
        if op.forward is not None and remade.op(op.forward):
            if start is None or unit(op.forward.op) != at:
                start, at = i, unit(op.forward.op)
            out[i] = start
        else:
            start = None
    return out


def _reads(op: PlanOp, remade: _Remade, swapped: set[PlanOp], held_as: Held
           ) -> tuple[VTensor, ...]:
    """A backward piece also reads what its forward saved: the forward's inputs and outputs
    autograd keeps (the weights it keeps a 16-bit copy of among them); a recomputed one
    only the inputs it does not make again (``remade``), a swapped one nothing (its saved
    tensors wait in CPU memory)."""
    forward = op.forward
    if forward is None or forward in swapped:
        return op.inputs
    if remade.op(forward):
        return (*op.inputs, *(v for v in forward.inputs if not remade.tensor(op.device, v)))
    kept = held_as.of(forward)
    if kept is None:
        return (*op.inputs, *forward.inputs, *forward.outputs)
    weights = (forward.inputs[j] for j in kept.cast
               if forward.inputs[j].ptensor.kind is TensorKind.PARAM)
    return (*op.inputs, *_saved(forward, kept), *weights)


def estimate_memory(plan: Plan, seq: list[PlanOp], stored: Storage, device: int,
                    held_as: Held | None = None, cells: dict | None = None) -> Memory:
    """What ``device`` holds running ``seq``; of a template (its pieces' ``cells``), with
    the other micro-batches its steps keep at once."""
    held_as = held_as or Held(plan)
    grad_of = {plan.grads[p]: p.name for p in plan.graph.params.values() if p in plan.grads}
    owned_grads = {name: [Mask(o.grad.index) for o in os_]
                   for name, os_ in stored.owned[device].items()}
    end = len(seq) - 1
    made: dict[tuple, int] = defaultdict(int)  # gradient shares added to a total so far
    first: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    size: dict[tuple, int] = {}
    gathered: dict[tuple, list[tuple[int, PlanOp]]] = defaultdict(list)  # key -> its readers
    remade = _Remade(plan)
    held = stored.stored[device]
    root: dict[tuple, tuple] = {}  # a view's key -> the key of the tensor it shares storage with
    rerun = _recomputed_at(seq, remade)
    for i, op in enumerate(seq):
        forward = op.forward or op
        kept = held_as.of(forward)
        if forward not in plan.swapped and (extra := held_as.other(forward)) and (
                not remade.op(forward) or i in rerun):
            first.setdefault(("kept", forward), rerun.get(i, i))  # statistics, masks, copies
            last[("kept", forward)] = i
            size[("kept", forward)] = extra
        if i in rerun and kept is not None:  # what its forward run again keeps, until here
            for v in _saved(forward, kept):
                if remade.tensor(device, v):
                    key: tuple = ("again", v.ptensor, v.mask)
                    first.setdefault(key, rerun[i])
                    last[key] = i
                    size[key] = held_as.nbytes(v)
        if temp := held_as.temp(op):
            first[("temp", op)] = last[("temp", op)] = i
            size[("temp", op)] = temp
        if op.is_backward and forward in plan.swapped and kept is not None:  # back from the
            first[("back", op)] = last[("back", op)] = i  # CPU for its backward alone
            size[("back", op)] = held_as.swapped(forward)
        if not op.is_backward and kept is not None:
            for out, src in kept.views:
                given = (op.inputs[src].ptensor, op.inputs[src].mask)
                root[(op.outputs[out].ptensor, op.outputs[out].mask)] = root.get(given, given)
        for v in (*_reads(op, remade, plan.swapped, held_as), *op.outputs):
            if v.ptensor in grad_of:  # a weight's gradient: alive from when it is made,
                within = Mask(v.mask.index)  # to the update where this device owns it;
                key = ("grad", v.ptensor, within)  # a share made again is added in
                if key in first and v in op.outputs:  # the first sum is a new tensor
                    made[key] += 1
                    first[("part", op, v)] = last[("part", op, v)] = i
                    size[("part", op, v)] = held_as.nbytes(v) * (2 if made[key] == 1 else 1)
                first.setdefault(key, i)
                last[key] = end if any(m.contains(within) for m in owned_grads.get(
                    grad_of[v.ptensor], ())) else max(last.get(key, i), i)
                size[key] = held_as.nbytes(v)
                continue
            if v.ptensor.kind is TensorKind.PARAM:
                again = op.forward is not None and remade.op(op.forward)
                if not again and (copy := held_as.copy(op, v)):  # each piece keeps its own
                    key = ("copy", op.forward or op, v.ptensor, v.mask)  # for its backward
                    first.setdefault(key, i)
                    last[key] = i
                    size[key] = copy
                if any(m.contains(Mask(v.mask.index)) for m in held.get(v.ptensor.name, ())):
                    continue  # the weight itself: counted with the parameters
            # A parameter region the device does not store (ZeRO-3) is gathered for the
            # pieces that read it, and autograd keeps it from the forward to the backward.
            key = root.get((v.ptensor, v.mask), (v.ptensor, v.mask))
            first.setdefault(key, i)
            last[key] = i
            size.setdefault(key, held_as.nbytes(v))
            if v.ptensor.kind is TensorKind.PARAM:
                gathered[key].append((i, op))
    alive = [(first[key], last[key], size[key]) for key in first]
    if plan.reshard:
        alive = [x for key, x in zip(first, alive) if key not in gathered] + \
            _resharded(gathered, size)
    states = optimizer_states(plan.optimizer)
    # The step's peak counts the gradients made by then; those kept are counted apart.
    kept_grads = sum(size[k] for k in first if k[0] == "grad" and last[k] == end)
    peak = _peak(len(seq), alive)
    if plan.micro > 1:  # a template: what each stage's forward keeps for its backward,
        kept_at: dict = defaultdict(int)  # held at once as the device's steps run them
        for key, (start, stop, n) in zip(first, alive):
            made_in, read_in = (cells or {}).get(seq[start]), (cells or {}).get(seq[stop])
            if key[0] not in ("grad", "part") and made_in and read_in and \
                    made_in[0] == "F" != read_in[0]:
                kept_at[made_in[1]] += n
        steps = plan.steps.get(device, [])
        others = max(0, held_at_most(steps, kept_at) - sum(kept_at.values()))
        acts = [x for key, x in zip(first, alive) if key[0] not in ("grad", "part")]
        later = acts + [(0, end, size[k]) for k in first if k[0] == "grad"] + [
            (first[k], first[k], 2 * size[k]) for k in first if k[0] == "grad"]
        # its micro-batch first, while the others hold what they keep, or the next, every
        # gradient made and each share summed with it into a new total (with others still
        # held if more micro-batches run than the device keeps at once)
        peak = max(peak + others, _peak(len(seq), later) + (
            others if plan.micro > micro_batches_kept(steps) else 0))
    peak = max(0, peak - kept_grads)
    return Memory(stored.bytes_stored(plan, device), stored.bytes_owned(plan, device, grads=True),
                  round(states * stored.bytes_updated(plan, device)), peak)


def _peak(n: int, alive: list[tuple[int, int, int]]) -> int:
    """The most bytes alive at once of (first, last, bytes) over ``n`` steps."""
    delta = [0] * (n + 1)
    for start, end, nbytes in alive:
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def _resharded(gathered: dict[tuple, list[tuple[int, PlanOp]]], size: dict[tuple, int],
               ) -> list[tuple[int, int, int]]:
    """When gathered parameter regions are alive (start, end, bytes), freed after their
    forward and gathered again for their backward where ``compile/reshard.py`` does so:
    every reader makes a new tensor, the forward reads come first, and another unit's
    forward runs in between."""
    def forward(key: tuple) -> list[int]:
        return [i for i, op in gathered[key] if not op.is_backward]

    units = {key: next((unit(op.op) for _, op in gathered[key] if not op.is_backward), None)
             for key in gathered}
    out = []
    for key, reads in gathered.items():
        ahead = forward(key)
        behind = [i for i, op in reads if op.is_backward]
        start, end = reads[0][0], reads[-1][0]
        if ahead and behind and ahead[-1] < behind[0] and all(
                op.op.kind in ALLOCATING for _, op in reads if not op.is_backward) and any(
                ahead[-1] < i < behind[0] for other in gathered
                if units[other] != units[key] for i in forward(other)):
            out += [(start, ahead[-1], size[key]), (behind[0], end, size[key])]
        else:
            out.append((start, end, size[key]))
    return out


def format_bytes(n: float) -> str:
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or suffix == "TiB":
            return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.1f} {suffix}"
        n /= 1024
    return f"{n} B"
