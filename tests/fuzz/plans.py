"""Random plans: splits (spatial, reduction and value), placements, orders, recompute,
split backwards and split updates, drawn from a seed.

A plan is kept as the list of primitive calls that made it, each naming ops by name, so
it can be replayed on a fresh ``Plan`` and printed as the Python that makes it again.
Some plans are wrong on purpose (a device out of range, an op left unplaced, a bad
split, an order that closes a cycle): those must be refused with an error that names
what is wrong.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import chronotope as ct
from chronotope.graph.ir import Op
from chronotope.plan.plan import PlanOp

Algorithm = ct.Split | ct.ValueSplit | ct.Replicate

# How a plan places its pieces: anywhere, a batch split per device (data parallel),
# contiguous stages of ops with micro-batches (pipeline), or dims cut across devices.
STYLES = ("scatter", "data", "stages", "tensor")
# Mistakes made on purpose, at most one per plan.
FAULTS = ("device", "unplaced", "split", "value", "again", "backward", "frozen-update",
          "recompute-and-swap")
FAULT_RATE = 0.12


@dataclass(frozen=True)
class Backward:
    """``plan.backward(of)``: the backward pieces of an op, named for ``order``."""

    of: Any

    def __str__(self) -> str:
        return f"plan.backward({_text(self.of)})"


@dataclass(frozen=True)
class Weight:
    """``plan.weight(of)``: the weight-gradient parts of a split backward."""

    of: Any

    def __str__(self) -> str:
        return f"plan.weight({_text(self.of)})"


@dataclass(frozen=True)
class Group:
    """``plan.group(names, name)``: several ops ordered as one."""

    names: tuple[str, ...]

    def __str__(self) -> str:
        return f"plan.group({list(self.names)!r}, {self.label!r})"

    @property
    def label(self) -> str:
        return "+".join(self.names)


@dataclass(frozen=True)
class Call:
    """One primitive call on the plan; ``param_storage`` sets that attribute."""

    method: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()

    def apply(self, plan: ct.Plan) -> Any:
        args = [_resolve(plan, a) for a in self.args]
        if self.method == "param_storage":
            plan.param_storage = args[0]
            return None
        return getattr(plan, self.method)(*args, **dict(self.kwargs))

    def __str__(self) -> str:
        if self.method == "param_storage":
            return f"plan.param_storage = {self.args[0]!r}"
        args = [_text(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
        return f"plan.{self.method}({', '.join(args)})"


def _resolve(plan: ct.Plan, arg: Any) -> Any:
    if isinstance(arg, Backward):
        return plan.backward(_resolve(plan, arg.of))
    if isinstance(arg, Weight):
        return plan.weight(_resolve(plan, arg.of))
    if isinstance(arg, Group):
        return plan.group(list(arg.names), arg.label)
    return arg


def _text(arg: Any) -> str:
    if isinstance(arg, Algorithm):
        return f"ct.{arg!r}"
    return str(arg) if isinstance(arg, Backward | Weight | Group) else repr(arg)


def replay(graph: ct.Graph, ndevices: int, calls: list[Call]) -> ct.Plan:
    """The plan ``calls`` make on ``graph``; raises what the first refused call raises."""
    plan = ct.Plan(graph, ndevices)
    for call in calls:
        call.apply(plan)
    return plan


def script(family: str, ndevices: int, calls: list[Call]) -> str:
    """Python that makes the plan again (the fuzzer's reproduction of a failure)."""
    lines = ["import chronotope as ct",
             "from tests.fuzz.families import family",
             f"workload, graph = family({family!r})",
             f"plan = ct.Plan(graph, {ndevices})"]
    return "\n".join(lines + [str(c) for c in calls])


class RandomPlan:
    """Draws one plan for ``graph`` from ``seed``, recording every call in ``calls``.

    ``build`` raises the ``ChronotopeError`` of the first call the plan refuses (a
    mistake made on purpose, or an order that makes a cycle, found by ``check``).
    """

    def __init__(self, graph: ct.Graph, seed: int) -> None:
        self.graph = graph
        self.rng = random.Random(seed)
        self.ndevices = self.rng.randint(2, 4)
        self.plan = ct.Plan(graph, self.ndevices)
        self.index = {op.name: i for i, op in enumerate(graph.ops)}
        self.calls: list[Call] = []
        self.style = self.rng.choice(STYLES)
        self.fault = self.rng.choice(FAULTS) if self.rng.random() < FAULT_RATE else None
        # fewer extra cuts on large graphs: the plan's size, not the model's, sets its cost
        self.cut_rate = min(0.7, 24 / len(graph.ops))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        c = Call(method, args, tuple(kwargs.items()))
        self.calls.append(c)
        return c.apply(self.plan)

    def build(self) -> ct.Plan:
        roots = list(self.graph.ops)
        stage_of = {op.name: i * self.ndevices // len(roots) for i, op in enumerate(roots)}
        micro = self.rng.choice((1, 2, 2, 4))
        for op in roots:
            self.place(op, self.partition(op, micro), stage_of[op.name])
        self.split_backwards()
        self.updates()
        self.recompute()
        self.orders(micro)
        self.mistake_late()
        self.plan.check()
        return self.plan

    # ---- partition and placement --------------------------------------------------------

    def partition(self, op: Op, micro: int) -> list[PlanOp]:
        """The op's pieces: the style's cut first, then random further cuts."""
        leaves = [self.plan.op(op.name)]
        first = self.style_cut(op, leaves[0], micro)
        if first is not None:
            leaves = self.call("trans", op.name, first)
        for _ in range(3):
            if self.rng.random() >= self.cut_rate:
                break
            leaf = self.rng.choice(leaves)
            algo = self.random_algorithm(leaf)
            cut = self.call("trans", leaf.name, algo)
            i = leaves.index(leaf)
            leaves[i:i + 1] = cut
        if self.fault == "again" and len(leaves) > 1 and self.rng.random() < 0.1:
            self.fault = None
            self.call("trans", op.name, ct.Replicate(2))
        return leaves

    def style_cut(self, op: Op, leaf: PlanOp, micro: int) -> Algorithm | None:
        if self.style == "data":
            return self.leading_split(op, leaf, self.ndevices) or ct.Replicate(self.ndevices)
        if self.style == "stages" and micro > 1:
            return self.leading_split(op, leaf, micro)
        if self.style == "tensor":
            dims = [d for d in splittable(op) if leaf.piece.sizes[d] % self.ndevices == 0]
            return ct.Split(self.rng.choice(dims), self.ndevices) if dims else \
                ct.Replicate(self.ndevices)
        return None

    def leading_split(self, op: Op, leaf: PlanOp, parts: int) -> ct.Split | None:
        """A cut of the first input's leading dim (the batch, where the op has one)."""
        sig = op.signature
        if sig is None or not sig.inputs or not sig.inputs[0]:
            return None
        dim = sig.inputs[0][0].factors[0].name
        if dim in sig.splittable() and leaf.piece.sizes[dim] % parts == 0:
            return ct.Split(dim, parts)
        return None

    def random_algorithm(self, leaf: PlanOp) -> Algorithm:
        """A split of a random dim (reduction dims included), a value split where the op
        is linear in some inputs, or replicas; now and then one the op cannot take."""
        parts = self.rng.choice((2, 2, 3, 4))
        sizes, sig = leaf.piece.sizes, leaf.op.signature
        # value shares (partial sums, value splits) of integers are refused: none here
        floats = all(t.dtype.is_floating_point for t in leaf.op.outputs)
        dims = [d for d in splittable(leaf.op)
                if sizes[d] % parts == 0 and (floats or not sig.dim(d).reduce)]
        opdef = self.plan.registry.of(leaf.op.target)
        shared = opdef.linear_in(len(leaf.op.inputs)) if opdef is not None else ()
        linear = bool(shared) and floats and all(
            leaf.op.inputs[j].dtype.is_floating_point for j in shared)
        if self.fault == "split" and self.rng.random() < 0.2:
            self.fault = None
            names = leaf.op.signature.names() if leaf.op.signature else ["d0"]
            return ct.Split(self.rng.choice(names), parts + 5)
        if self.fault == "value" and not linear and self.rng.random() < 0.2:
            self.fault = None
            return ct.ValueSplit(parts)
        kinds = ["split"] * 3 * bool(dims) + ["value"] * 2 * bool(linear) + ["replicate"]
        kind = self.rng.choice(kinds)
        if kind == "split":
            return ct.Split(self.rng.choice(dims), parts)
        if kind == "value":
            return ct.ValueSplit(parts)
        return ct.Replicate(self.rng.choice((2, 3)))

    def place(self, op: Op, leaves: list[PlanOp], stage: int) -> None:
        spread = self.style in ("data", "tensor")
        for i, leaf in enumerate(leaves):
            if self.fault == "unplaced" and self.rng.random() < 0.05:
                self.fault = None
                continue
            if self.fault == "device" and self.rng.random() < 0.05:
                self.fault = None
                self.call("assign", leaf.name, self.ndevices)
            if self.style == "stages" and self.rng.random() < 0.9:
                device = stage
            elif spread and self.rng.random() < 0.9:
                device = i % self.ndevices
            else:
                device = self.rng.randrange(self.ndevices)
            self.call("assign", leaf.name, device)

    # ---- backward, updates, recompute and order ------------------------------------------

    def split_backwards(self) -> None:
        if self.rng.random() < 0.2:
            for leaf in self.plan.forward_leaves():
                if self.rng.random() < 0.3:
                    self.call("split_backward", leaf.name)

    def updates(self) -> None:
        """Some parameters' optimizer steps cut over devices (ZeRO-like), their weights
        sometimes kept only where they are updated (ZeRO-3-like)."""
        if self.fault == "frozen-update":
            frozen = [n for n, t in self.graph.params.items()
                      if t not in self.plan.requires_grad]
            if frozen:
                self.call("update", self.rng.choice(frozen))
        if self.rng.random() >= 0.3:
            return
        for name, t in self.graph.params.items():
            if t not in self.plan.requires_grad or self.rng.random() < 0.5:
                continue
            update = self.call("update", name, whole_grad=self.rng.random() < 0.3)
            parts = self.rng.choice((2, self.ndevices))
            axes = [a for a, size in enumerate(t.shape) if size % parts == 0]
            algo = ct.Split(f"d{self.rng.choice(axes)}", parts) if axes else ct.Replicate(parts)
            for piece in self.call("trans", update.name, algo):
                self.call("assign", piece.name, self.rng.randrange(self.ndevices))
        if self.plan.updates and self.rng.random() < 0.4:
            self.call("param_storage", "owned")

    def recompute(self) -> None:
        """A run of consecutive ops recomputed (activation checkpointing), or a few pieces;
        a few others swapped."""
        roots = [op.name for op in self.graph.ops]
        if self.rng.random() < 0.3:
            start = self.rng.randrange(len(roots))
            for name in roots[start:start + self.rng.randint(1, 8)]:
                self.call("recompute", name)
        leaves = self.plan.forward_leaves()
        if self.rng.random() < 0.15:
            for leaf in self.rng.sample(leaves, min(3, len(leaves))):
                if leaf not in self.plan.recomputed:
                    self.call("recompute", leaf.name)
        if self.rng.random() < 0.1:
            for leaf in self.rng.sample(leaves, min(3, len(leaves))):
                if leaf not in self.plan.recomputed:
                    self.call("swap", leaf.name)
        if self.fault == "recompute-and-swap":
            leaf = self.rng.choice(leaves)
            self.call("recompute", leaf.name)
            self.call("swap", leaf.name)

    def orders(self, micro: int) -> None:
        """Random orders between pieces, ops, groups and backwards on a shared device; in
        a staged plan also 1F1B's (the next micro-batch's forward after a backward)."""
        if self.style == "stages" and micro > 1 and self.rng.random() < 0.5:
            self.one_f_one_b()
        if self.rng.random() < 0.5:
            return
        for _ in range(self.rng.randint(1, 3)):
            a, b = self.random_ref(), self.random_ref()
            if self.rng.random() < 0.75:  # mostly the way data flows: few close a cycle
                a, b = sorted((a, b), key=self.position)
            if self.shares_device(a, b) or self.rng.random() < 0.1:
                self.call("order", a, b)

    def position(self, ref: Any) -> int:
        """Where ``ref`` first runs in program order: forward ops, then backward reversed."""
        if isinstance(ref, Backward | Weight):
            return 2 * len(self.graph.ops) - self.position(ref.of)
        names = ref.names if isinstance(ref, Group) else (ref,)
        return min(self.index[self.plan.op(n).op.name] for n in names)

    def one_f_one_b(self) -> None:
        """On the last device, micro-batch 1's forward waits for micro-batch 0's backward."""
        last = self.ndevices - 1
        mine = [leaf for leaf in self.plan.forward_leaves() if leaf.device == last]
        first = tuple(leaf.name for leaf in mine if leaf.name.endswith(".0"))
        second = tuple(leaf.name for leaf in mine if leaf.name.endswith(".1"))
        if first and second and self.shares_device(Backward(Group(first)), Group(second)):
            self.call("order", Backward(Group(first)), Group(second))

    def random_ref(self) -> Any:
        leaves = self.plan.forward_leaves()
        kind = self.rng.choice(("leaf", "op", "group", "backward"))
        if kind == "op":
            return self.rng.choice(self.graph.ops).name
        if kind == "group":
            picked = self.rng.sample(leaves, min(len(leaves), self.rng.randint(2, 4)))
            return Group(tuple(leaf.name for leaf in picked))
        if kind == "backward" and self.plan.split and self.rng.random() < 0.3:
            return Weight(self.rng.choice(sorted(leaf.name for leaf in self.plan.split)))
        leaf = self.rng.choice(leaves).name
        return Backward(leaf) if kind == "backward" else leaf

    def shares_device(self, a: Any, b: Any) -> bool:
        ops = [self.plan.leaves(_resolve(self.plan, r)) for r in (a, b)]
        return bool({op.device for op in ops[0]} & {op.device for op in ops[1]})

    def mistake_late(self) -> None:
        if self.fault == "backward":
            leaf = self.rng.choice(self.plan.forward_leaves())
            self.call("assign", Backward(leaf.name), 0)


def splittable(op: Op) -> list[str]:
    return op.signature.splittable() if op.signature else []
