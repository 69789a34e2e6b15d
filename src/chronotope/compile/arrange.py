"""The first pass: what lowering wrote for each piece, put in the order its rank runs it.

Lowering writes each piece's code where it belongs (``Written``): the reads that come
before its call, the call, what it sends or sums after; and per rank what comes before
every piece (owners' sends of parameters) and after them (gradients handed to the
optimizer, the loss, buffers). ``arrange`` lays this out in the plan's order. A
template (``plan.micro``) is laid out as folding runs it: what runs once before the
micro-batches, then each step's pieces after a ``Block`` mark, then, after the end
mark, what runs once after them all.

Guarantees: every instruction lowering wrote appears once; a piece's reads come
before its call and its sends after it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from chronotope.compile.program import Block, Instruction
from chronotope.plan.plan import PlanOp
from chronotope.plan.steps import Cell


@dataclass
class Written:
    """The emitter's output: every instruction lowering wrote, at the place it runs."""

    ndevices: int
    pre: dict[PlanOp, list[Instruction]] = field(default_factory=lambda: defaultdict(list))
    main: dict[PlanOp, Instruction] = field(default_factory=dict)
    post: dict[PlanOp, list[Instruction]] = field(default_factory=lambda: defaultdict(list))
    head: list[list[Instruction]] = field(init=False)  # owners' sends of parameters
    tail: list[list[Instruction]] = field(init=False)  # after every piece
    # a template's: what a rank receives once for every micro-batch's reads, before them,
    # and what it sends of their sums, after them all
    received_once: list[list[Instruction]] = field(init=False)
    sent_once: list[list[Instruction]] = field(init=False)

    def __post_init__(self) -> None:
        for name in ("head", "tail", "received_once", "sent_once"):
            setattr(self, name, [[] for _ in range(self.ndevices)])

    def of(self, ops: list[PlanOp]) -> list[Instruction]:
        """The code of ``ops``, one after the other."""
        return [x for op in ops for x in (*self.pre[op], self.main[op], *self.post[op])]


def arrange(written: Written, sequences: dict[int, list[PlanOp]],
            cells: dict[PlanOp, Cell]) -> list[list[Instruction]]:
    """Every rank's code: its pieces in ``sequences``' order, or a template's steps
    (``cells``: the step of each piece that runs per micro-batch)."""
    return [written.head[rank] + (_in_blocks(written, rank, seq, cells) if cells else
                                  written.of(seq)) + written.tail[rank]
            for rank, seq in sorted(sequences.items())]


def _in_blocks(written: Written, rank: int, seq: list[PlanOp], cells: dict[PlanOp, Cell],
               ) -> list[Instruction]:
    """A template rank's code: first what runs once before the micro-batches (forward
    pieces of no cell: tables from weights, counts from the labels; what the steps receive
    once), then each step's pieces after a ``Block`` mark, in the order the template runs
    them, then, after the end mark, what the rank sends of its micro-batches' sums and the
    backward of what ran once."""
    steps: dict[Cell, list[PlanOp]] = {}
    for op in seq:
        if op in cells:
            steps.setdefault(cells[op], []).append(op)
    out = [*written.of([op for op in seq if op not in cells and not op.is_backward]),
           *written.received_once[rank]]
    for cell, ops in steps.items():
        out += [Block(cell), *written.of(ops)]
    return [*out, Block(None), *written.sent_once[rank],
            *written.of([op for op in seq if op not in cells and op.is_backward])]
