"""A template's program run for every micro-batch: one micro-batch compiled, all of them run.

A template plan (``Plan.micro_batches``) holds micro-batch 0's pieces. Its compiled
code has, per rank, what runs once before the micro-batches, one block per step of
its stages (``Block`` marks), and after the end mark what runs once after them. Each
rank's program is that code with every block run once per micro-batch, in the order
its steps list them:

* what a block makes is that micro-batch's own: its names get the micro-batch's
  suffix, its messages their own tags, its collectives their own keys, and a
  ``Micro`` mark keeps its pieces' autograd state apart from the others';
* what it reads of the batch is that micro-batch's rows: an input's, or those of a
  value made once before (a count of the labels), moved along the batch axis; what it
  draws at random is what the counter stream gives that micro-batch's rows;
* what runs once after the micro-batches reads the sum of every micro-batch's part of
  what a block made (a weight's gradient, the loss), each part added as soon as it is
  made to a running total the runtime keeps (``Accumulate``), so that every
  micro-batch's step is the same code (``compile/outline.py`` writes it once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from chronotope.compile.program import (
    COLLECTIVES,
    STARTED,
    Accumulate,
    AllToAll,
    Assemble,
    Backward,
    Block,
    Broadcast,
    Exchange,
    Forward,
    Instruction,
    Leave,
    Load,
    Micro,
    Part,
    Recv,
    Rows,
    Send,
    Total,
    Wait,
    WeightGrad,
    reads,
    writes,
)
from chronotope.errors import PlanError
from chronotope.graph import rng
from chronotope.graph.axes import batch_dims, batch_start
from chronotope.graph.ir import Graph, PTensor, fresh_name
from chronotope.graph.mask import Mask, VTensor
from chronotope.plan.plan import Plan, PlanOp
from chronotope.plan.steps import Cell, Kind, Step

_ONCE = ("param", "constant", "buffer")  # loads alike in every micro-batch


def fold(ranks: list[list[Instruction]], plan: Plan, tensor_of: list[dict[str, PTensor]],
         shapes: list[dict[str, tuple[int, ...]]], whole: list[set[str]]
         ) -> list[list[Instruction]]:
    """Every rank's template code (no frees yet) run for each micro-batch in its steps;
    ``whole``: each rank's local tensors that hold a whole value, not a part of a sum."""
    parts = [_split(code) for code in ranks]
    _refuse_once_to_block(parts)
    stride = 1 + max((ins.tag for code in ranks for ins in code
                      if isinstance(ins, (Send, Recv))), default=0)
    axes = batch_axes(plan.graph)
    return [_Folder(rank, plan.steps.get(rank, []), *parts[rank], stride, axes, plan.micro_runs,
                    tensor_of[rank], shapes[rank], whole[rank]).run()
            for rank in range(len(ranks))]


def batch_axes(graph: Graph) -> dict[PTensor, int]:
    """The axis along which the ops the batch flows through read each tensor: the one
    their batch dim is on, which a micro-batch takes its rows of (an attention mask
    broadcast to the batch's size by ops the batch does not flow through included)."""
    axis = dict(batch_start(graph))
    for op, dim in batch_dims(graph).items():
        if dim is None or op.signature is None:
            continue
        for t, dims in zip(op.inputs, op.signature.inputs):
            found = next((a for a, ax in enumerate(dims) if ax.factors[0].name == dim), None)
            if found is not None:
                axis.setdefault(t, found)
    return axis


def _split(code: list[Instruction]
           ) -> tuple[list[Instruction], dict[Cell, list[Instruction]], list[Instruction]]:
    """(before the micro-batches, each step's block, after them) of a rank's code."""
    before: list[Instruction] = []
    blocks: dict[Cell, list[Instruction]] = {}
    after: list[Instruction] = []
    into = before
    for ins in code:
        if isinstance(ins, Block):
            into = blocks.setdefault(ins.cell, []) if ins.cell is not None else after
        else:
            into.append(ins)
    return before, blocks, after


def _refuse_once_to_block(parts) -> None:
    """A block that receives what another rank made once (or sends what another rank
    reads once) would take one message per micro-batch where one was sent."""
    once = {(ins.tag, "send") for before, _, after in parts for ins in (*before, *after)
            if isinstance(ins, Send)} | \
        {(ins.tag, "recv") for before, _, after in parts for ins in (*before, *after)
         if isinstance(ins, Recv)}
    for _, blocks, _ in parts:
        for cell, code in blocks.items():
            for ins in code:
                other = "send" if isinstance(ins, Recv) else "recv" \
                    if isinstance(ins, Send) else None
                if other and (ins.tag, other) in once:
                    raise PlanError(
                        f"step {cell[0]}{cell[1]} of the template exchanges {ins.var} with a "
                        "rank that runs it once a step, not once per micro-batch: run what "
                        "makes it on the ranks that read it, or compile without fold")


class _Folder:
    def __init__(self, rank: int, steps: list[Step], before, blocks, after, stride: int,
                 axes: dict[PTensor, int], runs: dict[PTensor, int],
                 tensor_of: dict[str, PTensor],
                 shapes: dict[str, tuple[int, ...]], whole: set[str]) -> None:
        self.rank, self.steps, self.stride, self.axes = rank, steps, stride, axes
        self.runs = runs
        # what every micro-batch loads alike (weights, constants) is loaded once, before
        loads = [ins for code in blocks.values() for ins in code
                 if isinstance(ins, Load) and ins.source in _ONCE]
        blocks = {cell: [ins for ins in code if not (isinstance(ins, Load)
                                                     and ins.source in _ONCE)]
                  for cell, code in blocks.items()}
        self.before, self.blocks, self.after = [*loads, *before], blocks, after
        self.tensor_of, self.shapes = tensor_of, shapes
        self.made = {v for code in blocks.values() for ins in code for v in writes(ins)}
        # what runs once after the micro-batches reads of what each block makes: summed,
        # but for a whole value every micro-batch makes alike (the gradient of an input a
        # value split reads a share of, as a replica): micro-batch 0's is read
        self.summed = {v for ins in after for v in reads(ins) if v in self.made
                       and v not in whole}
        self.taken = set(shapes) | self.made
        self.names: dict[int, dict[str, str]] = {}
        self.drawn: dict[tuple[PlanOp, int], PlanOp] = {}  # random pieces, per micro-batch
        # what each block's instructions make that a total sums, by position (alike in
        # every micro-batch)
        self.sums = {cell: [[v for v in writes(ins) if v in self.summed] for ins in code]
                     for cell, code in blocks.items()}
        self.moves: dict[int, bool] = {}  # by id: whether own_rows changes it

    def run(self) -> list[Instruction]:
        missing = [cell for cell in self.blocks if not any(s[:2] == cell for s in self.steps)]
        if missing:
            raise PlanError(f"rank {self.rank} has blocks {missing} that no step runs")
        early = next((v for ins in self.before for v in reads(ins) if v in self.made), None)
        if early is not None:
            raise PlanError(f"rank {self.rank} reads {early} once before the micro-batches, "
                            "but a micro-batch's step makes it: compile without fold")
        out = list(self.before)
        totals: dict[str, str] = {}  # each sum, once its last micro-batch's part is in
        summed = {cell: [v for ins in code for v in writes(ins) if v in self.summed]
                  for cell, code in self.blocks.items()}
        last = {v: k for k, step in enumerate(self.steps) for v in summed.get(step[:2], ())}
        # each total by the tensor it sums (and which of this rank's pieces of it)
        pieces: dict[str, list[str]] = {}
        for v in sorted(self.summed):
            pieces.setdefault(self.tensor_of[v].name, []).append(v)
        key = {v: name if len(vs) == 1 else f"{name}#{i}"
               for name, vs in pieces.items() for i, v in enumerate(vs)}
        split = any(step.kind is Kind.W for step in self.steps)
        for k, step in enumerate(self.steps):
            kind, stage, m = step
            block = self.blocks.get((kind, stage), [])
            out.append(Micro(m, step.action(split)))
            names = self.names_of(m) if m else {}
            for ins, sums in zip(block, self.sums.get((kind, stage), ())):
                out.append(self.instance(ins, m, names) if m else ins)
                out += [Accumulate(key[v], self.name(v, m), self.tensor_of[v].dtype)
                        for v in sums]  # each part added to its total as soon as it is made
            for v in summed.get((kind, stage), []):
                if last[v] == k:
                    totals[v] = fresh_name(f"{v}_sum", self.taken)
        # each total taken where what runs once after the micro-batches first reads it
        done = {totals[v]: Total(totals[v], key[v]) for v in totals}
        after = []
        for ins in self.after:
            ins = _renamed(ins, totals)
            after += [done.pop(v) for v in reads(ins) if v in done] + [ins]
        return out + ([Micro(None), *after] if self.steps else after)

    def names_of(self, m: int) -> dict[str, str]:
        """Micro-batch ``m``'s name of everything the blocks make."""
        if m not in self.names:
            self.names[m] = {v: fresh_name(f"{v}_m{m}", self.taken) for v in sorted(self.made)}
        return self.names[m]

    def name(self, var: str, m: int) -> str:
        return self.names_of(m)[var] if m and var in self.made else var

    def instance(self, ins: Instruction, m: int, names: dict[str, str]) -> Instruction:
        """Micro-batch ``m``'s run of a block's instruction (``names``: its names)."""
        ins = _renamed(self.own_rows(ins, m), names)
        if isinstance(ins, (Send, Recv)):
            return replace(ins, tag=ins.tag + m * self.stride)
        if isinstance(ins, COLLECTIVES):
            if isinstance(ins, (AllToAll, Exchange, Broadcast, Leave)):
                return replace(ins, key=ins.key.marked(("micro", m)))
            return replace(ins, keys=tuple(k.marked(("micro", m)) for k in ins.keys))
        if isinstance(ins, Load) and ins.source == "input":
            return replace(ins, mask=self.rows(ins.tensor, ins.mask, m))
        return ins

    def own_rows(self, ins: Instruction, m: int) -> Instruction:
        """``ins`` reading micro-batch ``m``'s rows of what ran once before the micro-batches
        and drawing its random numbers (what a backward makes again included)."""
        if id(ins) not in self.moves:  # most read no such rows and draw nothing
            self.moves[id(ins)] = any(self.piece_rows(x, 1) != x for x in (
                ins.recompute if isinstance(ins, Backward) else (ins,))
                if isinstance(x, (Assemble, Forward)))
        if not self.moves[id(ins)]:
            return ins
        if isinstance(ins, (Assemble, Forward)):
            return self.piece_rows(ins, m)
        if isinstance(ins, Backward) and ins.recompute:
            return replace(ins, recompute=tuple(self.piece_rows(f, m) for f in ins.recompute))
        return ins

    def piece_rows(self, ins: Forward | Assemble, m: int) -> Forward | Assemble:
        if isinstance(ins, Assemble):
            return replace(ins, parts=[self.part_rows(p, m) for p in ins.parts])
        if any(v not in self.made and self.batched(v) for v in ins.ins):
            raise PlanError(f"{ins.op.name} reads all of the batch in each micro-batch")
        return self.draws_at(ins, m)

    def draws_at(self, ins: Forward, m: int) -> Forward:
        """A piece that draws random numbers draws micro-batch ``m``'s: those of its rows of
        the whole op's output (the counter stream numbers them by position)."""
        op = ins.op
        if not rng.drawn(op.op.target):
            return ins
        if (op, m) not in self.drawn:
            out = op.outputs[0]
            if out.ptensor not in self.axes:
                raise PlanError(f"{op.name} draws random numbers, and which of its output's "
                                "axes holds the batch is not known: compile without fold")
            moved = VTensor(out.ptensor, self.rows(out.ptensor, out.mask, m))
            self.drawn[(op, m)] = replace(op, piece=replace(
                op.piece, outputs=(moved, *op.piece.outputs[1:])))
        return replace(ins, op=self.drawn[(op, m)])

    def batched(self, var: str) -> bool:
        """Whether ``var``, made once before the micro-batches, holds every micro-batch's
        rows (each block reads its own)."""
        return self.tensor_of.get(var) in self.axes

    def part_rows(self, p: Part, m: int) -> Part:
        """A part read from what ran once before the micro-batches: micro-batch ``m``'s
        rows of it."""
        if p.src in self.made:
            return p
        if p.src not in self.tensor_of:
            raise PlanError(f"rank {self.rank}: which tensor {p.src} holds is not known, so "
                            "its micro-batches' rows are not either; this is a bug in "
                            "chronotope, please report it with the plan")
        if not self.batched(p.src):
            return p
        t = self.tensor_of[p.src]
        a = self.axes[t]
        moved = list(p.src_slices)
        lo, hi = p.src_slices[a].start, p.src_slices[a].stop
        moved[a] = slice(*self.later(t, lo, hi, m))
        return replace(p, src_slices=tuple(moved))

    def rows(self, t: PTensor, mask: Mask, m: int) -> Mask:
        """Micro-batch ``m``'s rows of ``t`` where ``mask`` has micro-batch 0's."""
        a = self.axes.get(t)
        if a is None:
            return mask
        moved = list(mask.index)
        moved[a] = self.later(t, *mask.index[a], m)
        return Mask(tuple(moved), mask.value)

    def later(self, t: PTensor, lo: int, hi: int, m: int) -> tuple[int, int]:
        """Micro-batch ``m``'s run of ``t`` along its batch axis, where micro-batch 0's is
        ``lo:hi``: a micro-batch's run further (the template's, ``Plan.micro_runs``, which a
        piece of a flattened ``(b t)`` axis holds only a part of)."""
        step = self.runs.get(t, hi - lo)
        return lo + m * step, hi + m * step


def _renamed(ins: Instruction, names: dict[str, str]) -> Instruction:
    """``ins`` with every local name in ``names`` renamed (others kept)."""
    n: Callable[[Any, Any], Any] = names.get  # n(v, v); None is no name

    def ns(vs: tuple) -> tuple:
        return tuple(map(n, vs, vs))

    def changed(**fields) -> Instruction:  # a shallow copy: much cheaper than replace()
        out = object.__new__(type(ins))
        out.__dict__.update(ins.__dict__, **fields)
        return out

    if isinstance(ins, Forward):
        return changed(ins=ns(ins.ins), outs=ns(ins.outs))
    if isinstance(ins, Backward):
        return changed(grad_outputs=tuple(map(ns, ins.grad_outputs)),
                       outs=tuple(map(ns, ins.outs)),
                       recompute=tuple(_renamed(f, names) for f in ins.recompute))
    if isinstance(ins, WeightGrad):
        return changed(outs=ns(ins.outs))
    if isinstance(ins, Assemble):
        return changed(var=n(ins.var, ins.var),
                       parts=[replace(p, src=n(p.src, p.src)) for p in ins.parts])
    if isinstance(ins, Wait):
        return changed(handle=n(ins.handle, ins.handle), vars=ns(ins.vars))
    if isinstance(ins, STARTED):
        handle = n(ins.handle, ins.handle)
        if isinstance(ins, Recv):
            return changed(var=n(ins.var, ins.var), handle=handle, rows=_rows(ins.rows, names))
        if isinstance(ins, (AllToAll, Broadcast)):
            return changed(var=n(ins.var, ins.var), src=n(ins.src, ins.src), handle=handle)
        if isinstance(ins, Exchange):
            return changed(sends=tuple(_renamed(m, names) for m in ins.sends),
                           recvs=tuple(_renamed(m, names) for m in ins.recvs), handle=handle)
        srcs = tuple(ns(s) if isinstance(s, tuple) else n(s, s) for s in ins.srcs)
        return changed(vars=ns(ins.vars), srcs=srcs, handle=handle)
    if isinstance(ins, Send):
        return changed(var=n(ins.var, ins.var), rows=_rows(ins.rows, names))
    if hasattr(ins, "var"):
        return changed(var=n(ins.var, ins.var))
    if hasattr(ins, "vars"):
        return changed(vars=ns(ins.vars))
    return ins


def _rows(rows: Rows | None, names: dict[str, str]) -> Rows | None:
    """A routed message's rows, its routing index renamed."""
    if rows is None or rows.index is None:
        return rows
    return replace(rows, index=names.get(rows.index, rows.index))
