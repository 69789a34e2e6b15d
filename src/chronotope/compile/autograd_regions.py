"""Autograd regions: backward pieces a rank runs back to back become one autograd call.

As materialized, every forward piece starts from detached leaves and every
backward piece is one ``torch.autograd.grad`` call: exact, but for small ops the
Python cost per piece outweighs the arithmetic. Where backward pieces follow one
another with only local gradient sums between them, a piece's input that is a
local producer's output (or a view of it) stays connected to that producer, the
gradient between them flows inside autograd, and the pieces share one call.
What crosses the region's edge (gradients arriving from outside, gradients of
its leaves) is computed exactly as before, so communication does not change.
The weight-gradient part of a split backward runs after its region's call.
A region also runs its recomputed forward pieces again first (``plan.recompute``),
and, without a graph, the recomputed pieces that make what they read, back to what
the forward kept: the forward keeps only a recomputed run's inputs, however many
regions its backward is cut into. An edge between a recomputed piece and a kept one
is never linked, and a recomputed piece that links to none of a region starts its
own (co-shard parts then each make their activations again only when their own
backward runs).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

from chronotope.compile.program import (
    Assemble,
    Backward,
    Forward,
    Instruction,
    Load,
    Part,
    Reshard,
    Slices,
    WeightGrad,
    covers,
    reads,
    writes,
)
from chronotope.plan.plan import PlanOp

_LOCAL = (Backward, Assemble, Load, WeightGrad)  # what a region may span: no communication


@dataclass
class _Region:
    members: list[Backward] = field(default_factory=list)
    grads: list[list[str | None]] = field(default_factory=list)  # per member: arriving
    outs: list[list[str | None]] = field(default_factory=list)  # per member: leaving
    pending: set[str] = field(default_factory=set)  # known only once the call ran
    deferred: dict[int, Instruction] = field(default_factory=dict)  # id -> step that needs them
    leaving_at: dict[str, tuple[int, int]] = field(default_factory=dict)  # var -> (member, j)


def autograd_regions(code: list[Instruction]) -> list[Instruction]:
    """One rank's code (before frees are placed) with runs of backward pieces fused."""
    return _Fuser(code).run()


class _Fuser:
    def __init__(self, code: list[Instruction]) -> None:
        self.code = code
        self.readers: dict[str, list[Instruction]] = defaultdict(list)
        self.defined: dict[str, Instruction] = {}
        for ins in code:
            for var in reads(ins):
                self.readers[var].append(ins)
            for var in writes(ins):
                self.defined[var] = ins
        self.forwards = {ins.op: ins for ins in code if isinstance(ins, Forward)}
        self.position = {id(ins): i for i, ins in enumerate(code)}
        # forward output var -> (piece, position among the outputs that pass a gradient)
        self.output_of: dict[str, tuple[PlanOp, int]] = {}
        for fwd in self.forwards.values():
            graded = [o for o, g in zip(fwd.outs, fwd.out_grad) if g]
            for k, var in enumerate(graded):
                self.output_of[var] = (fwd.op, k)
        self.linked: set[tuple[PlanOp, int]] = set()  # (forward piece, input position)
        self.made_again: set[str] = set()  # what the regions so far ran again
        # gathered and freed after the forward, filled again right before their backward
        self.resharded = {v for ins in code if isinstance(ins, Reshard) for v in ins.vars}

    def run(self) -> list[Instruction]:
        out: list[Instruction] = []
        region = _Region()
        for ins in self.code:
            if not isinstance(ins, _LOCAL):
                self.close(region, out)
                region = _Region()
                out.append(ins)
            elif isinstance(ins, Backward):
                if not self.join(region, ins, out):
                    self.close(region, out)
                    region = _Region()
                    self.join(region, ins, out)
            elif set(reads(ins)) & region.pending or (  # needs the region's call first
                    isinstance(ins, WeightGrad)
                    and any(m.ops[0].forward is ins.op.forward for m in region.members)):
                region.deferred[id(ins)] = ins
                region.pending.update(writes(ins))
            else:
                out.append(ins)
        self.close(region, out)
        return [self.patched(ins) for ins in out]

    def again(self, ins: Instruction | None) -> bool:
        """Whether ``ins`` may run again in the backward: a recomputed piece, or a view of
        what those or other views make, reading nothing freed since (gathered, resharded).
        Not a sum of parts (co-shard parts' outputs added up): kept, it spares making
        every part again for what reads it."""
        if isinstance(ins, Forward):
            return ins.recompute and not self.resharded.intersection(ins.ins)
        if not isinstance(ins, Assemble) or ins.accumulate:
            return False
        boxes = {tuple((s.start, s.stop) for s in p.dst_slices) for p in ins.parts}
        return len(boxes) == len(ins.parts) and all(
            p.src not in self.resharded and isinstance(
                source := self.defined.get(p.src), (Forward, Assemble))
            and (isinstance(source, Assemble) or source.recompute) for p in ins.parts)

    def close(self, region: _Region, out: list[Instruction]) -> None:
        if region.members:
            remade = self.remade([self.forwards[m.ops[0].forward_op] for m in region.members
                                  if self.forwards[m.ops[0].forward_op].recompute])
            out.append(Backward(tuple(m.ops[0] for m in region.members),
                                tuple(map(tuple, region.grads)), tuple(map(tuple, region.outs)),
                                remade))
        out += region.deferred.values()

    def remade(self, pieces: list[Forward]) -> tuple[Forward | Assemble, ...]:
        """What a region runs again first, in order: its recomputed pieces and the views
        between them, with their graph, and, without one, the recomputed pieces and views
        that make what those read, back to what the forward kept (or an earlier region
        made again): the forward keeps a recomputed run's inputs only, however many
        regions its backward takes (a co-shard part's attention, cut where its q, k and v
        meet)."""
        chosen: dict[int, Forward | Assemble] = {id(f): f for f in pieces}
        made = {v for f in pieces for v in writes(f)}
        for f in pieces:
            for v in reads(f):
                self.viewed(v, made, chosen)
        graphed = set(chosen)
        wanted = [v for f in chosen.values() for v in reads(f)]
        while wanted:
            v = wanted.pop()
            source = self.defined.get(v)
            if v in made or v in self.made_again or id(source) in chosen \
                    or not self.again(source):
                continue
            assert isinstance(source, (Forward, Assemble))
            chosen[id(source)] = source
            made.update(writes(source))
            wanted += reads(source)
        self.made_again |= made
        return tuple(i if id(i) in graphed or isinstance(i, Assemble) else replace(
            i, grad=tuple(False for _ in i.grad), out_grad=(), linked=())
            for i in sorted(chosen.values(), key=lambda i: self.position[id(i)]))

    def viewed(self, var: str, made: set[str], found: dict[int, Forward | Assemble]) -> bool:
        """Whether ``var`` is made in the region or a view of what is (at any depth); the
        views are added to ``found`` and ``made``: run again, they join its graph."""
        if var in made:
            return True
        a = self.defined.get(var)
        if not isinstance(a, Assemble) or not a.parts or a.accumulate:
            return False
        if not all(self.viewed(p.src, made, found) for p in a.parts):
            return False
        found[id(a)] = a
        made.add(a.var)
        return True

    def join(self, region: _Region, b: Backward, out: list[Instruction]) -> bool:
        """Add piece ``b`` to ``region`` if every gradient it reads is known before the
        region's call or flows inside it (then the forward edge carrying it is linked)."""
        (op,), (grads,), (outs,) = b.ops, b.grad_outputs, b.outs
        producer = op.forward_op
        arriving: list[str | None] = []
        links: list[tuple[PlanOp, int]] = []
        linked_grads: list[str] = []  # the gradients those edges carried
        rewrites: list[tuple[Assemble, Assemble | None]] = []
        for k, g in enumerate(grads):
            if g is None or g not in region.pending:
                arriving.append(g)
                continue
            source = self.defined[g]
            edge = self.link(region, g, producer, k, None)
            if edge is not None:
                links.append(edge)
                linked_grads.append(g)
                arriving.append(None)
                continue
            if not (isinstance(source, Assemble) and id(source) in region.deferred
                    and len(self.readers[g]) == 1):
                return False
            kept = []
            for part in source.parts:
                if part.src not in region.pending:
                    kept.append(part)
                elif (edge := self.link(region, part.src, producer, k, part)) is not None:
                    links.append(edge)
                    linked_grads.append(part.src)
                else:
                    return False
            rewrites.append((source, replace(source, parts=kept, pattern=None) if kept else None))
            arriving.append(g if kept else None)
        if region.members and not links and self.forwards[producer].recompute:
            return False  # an independent piece made again: its own region, its own peak
        self.linked.update(links)
        for gx in linked_grads:  # that input's gradient now flows inside: nothing leaves
            m, j = region.leaving_at.pop(gx)
            region.pending.discard(gx)
            region.outs[m][j] = None
        for source, rewritten in rewrites:  # now computable before the call: out of the deferred
            del region.deferred[id(source)]
            if rewritten is not None:
                out.append(rewritten)
        region.members.append(b)
        region.grads.append(arriving)
        region.outs.append(list(outs))
        for j, var in enumerate(outs):
            if var is not None:
                region.pending.add(var)
                region.leaving_at[var] = (len(region.members) - 1, j)
        return True

    def link(self, region: _Region, gx: str, producer: PlanOp, k: int,
             part: Part | None) -> tuple[PlanOp, int] | None:
        """The (consumer, input) edge whose input gradient ``gx`` is, when it may flow
        inside autograd: a member's input that is output ``k`` of ``producer`` or a view of
        it, ``gx`` read only where it adds into that output's gradient, at the view's box."""
        if len(self.readers[gx]) != 1 or gx not in region.leaving_at:
            return None
        m, j = region.leaving_at[gx]
        consumer = self.forwards[region.members[m].ops[0].forward_op]
        i = consumer.input_grads()[j]
        origin = self.origin(consumer.ins[i])
        if origin is None or self.output_of.get(origin[0]) != (producer, k):
            return None
        if consumer.recompute != self.forwards[producer].recompute:
            return None  # one side's graph is made again in backward, the other's is not
        if consumer.input_shares and consumer.input_shares[i] != 1:
            return None  # a share's gradient is the whole value's: it enters as a leaf
        box = origin[1]
        shape = tuple(producer.outputs[self.graded_output(producer, k)].mask.shape)
        if part is None:
            fits = box is None or covers(box, shape)
        else:
            size = tuple(s.stop - s.start for s in part.dst_slices)
            fits = covers(part.src_slices, size) and (
                part.dst_slices == box if box is not None else covers(part.dst_slices, shape))
        return (consumer.op, i) if fits else None

    def origin(self, var: str) -> tuple[str, Slices | None] | None:
        """The forward output ``var`` is, or is a view of (with the box it takes)."""
        if var in self.output_of:
            return var, None
        source = self.defined.get(var)
        if isinstance(source, Assemble) and len(source.parts) == 1:
            p = source.parts[0]
            if p.scale == 1 and covers(p.dst_slices, source.shape) and p.src in self.output_of:
                return p.src, p.src_slices
        return None

    def graded_output(self, producer: PlanOp, k: int) -> int:
        """Index among all outputs of ``producer`` of its ``k``-th gradient-passing one."""
        return [j for j, g in enumerate(self.forwards[producer].out_grad) if g][k]

    def patched(self, ins: Instruction) -> Instruction:
        if isinstance(ins, Backward) and ins.recompute:
            return replace(ins, recompute=tuple(
                self.linked_inputs(f) if isinstance(f, Forward) and any(f.grad) else f
                for f in ins.recompute))
        return self.linked_inputs(ins) if isinstance(ins, Forward) else ins

    def linked_inputs(self, ins: Forward) -> Forward:
        """A forward piece with the inputs whose gradients flow inside autograd marked."""
        linked = tuple((ins.op, i) in self.linked for i in range(len(ins.ins)))
        return replace(ins, linked=linked) if any(linked) else ins
