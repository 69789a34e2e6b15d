"""The compiler after lowering: a named list of passes over every rank's code, in order.

Lowering (``compile/materialize.py``) resolves every read of every piece into
messages, collectives it recognises and local assembly, and writes each piece's
code; ``arrange`` lays it out per rank, and each pass after it takes every rank's
code and returns it, keeping what its module says it guarantees.
Where a pass reorders code, the replay engine (``compile/replay.py``) checks that
it still runs through, and the pass keeps the order it had when not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from chronotope.compile.arrange import Written, arrange
from chronotope.compile.autograd_regions import autograd_regions
from chronotope.compile.buckets import buckets
from chronotope.compile.collectives import collectives
from chronotope.compile.fold import fold
from chronotope.compile.frees import with_frees
from chronotope.compile.names import Names
from chronotope.compile.overlap import overlap
from chronotope.compile.program import Instruction
from chronotope.compile.reshard import reshard
from chronotope.compile.ring import ring
from chronotope.compile.running_sums import running_sums
from chronotope.errors import PlanError
from chronotope.plan.plan import Plan, PlanOp
from chronotope.plan.steps import Cell

Code = list[list[Instruction]]  # every rank's instructions


@dataclass
class Lowered:
    """What lowering wrote, and every rank's code as the passes so far made it."""

    plan: Plan
    written: Written  # each piece's code, each rank's head and tail
    sequences: dict[int, list[PlanOp]]  # each rank's pieces in the order it runs them
    cells: dict[PlanOp, Cell]  # a template's (``plan.micro``): the step of each step's piece
    names: Names  # each rank's local names, their shapes and what they hold
    bucket_bytes: float  # gradient reductions start in buckets of this size
    ranks: Code = field(default_factory=list)  # laid out by the first pass, ``arrange``

    @property
    def template(self) -> bool:
        """A template's code: its blocks run once per micro-batch."""
        return bool(self.cells)


def _buckets(lowered: Lowered) -> Code:
    """Gradient reductions in buckets (a template's after ``fold``, in ``_overlap``)."""
    return lowered.ranks if lowered.template else buckets(lowered.ranks, lowered.bucket_bytes)


def _reshard(lowered: Lowered) -> Code:
    """Gathered weights (ZeRO-3) and activations freed after their forward; not a template's
    activations, whose blocks run again for every micro-batch in the schedule's order."""
    plan = lowered.plan
    activations = plan.regather and not lowered.template
    if not (plan.reshard or activations):
        return lowered.ranks
    return [reshard(code, plan.reshard, activations) for code in lowered.ranks]


def _autograd_regions(lowered: Lowered) -> Code:
    return [autograd_regions(code) for code in lowered.ranks]


def _running_sums(lowered: Lowered) -> Code:
    return [running_sums(rank, code, lowered) for rank, code in enumerate(lowered.ranks)]


def _fold(lowered: Lowered) -> Code:
    if not lowered.template:
        return lowered.ranks
    names = lowered.names
    return fold(lowered.ranks, lowered.plan, names.tensor_of, names.shapes, names.whole)


def _overlap(lowered: Lowered) -> Code:
    """Communication started ahead of its readers; a template's (long, folded) code gets
    its gradient buckets here too, checked by the one replay overlap runs."""
    if not lowered.template:
        return overlap(lowered.ranks)
    try:
        return overlap(buckets(lowered.ranks, lowered.bucket_bytes, check=False))
    except PlanError:
        return overlap(lowered.ranks)


def _ring(lowered: Lowered) -> Code:
    """Ring attention; a template's backward keeps its messages (its blocks run once per
    micro-batch, the gathers' handles live in one)."""
    if not lowered.plan.ring:
        return lowered.ranks
    return ring(lowered.ranks, backward=not lowered.template)


def _frees(lowered: Lowered) -> Code:
    return [with_frees(code) for code in lowered.ranks]


PASSES: list[tuple[str, Callable[[Lowered], Code]]] = [
    ("arrange", lambda lowered: arrange(lowered.written, lowered.sequences, lowered.cells)),
    ("collectives", lambda lowered: collectives(lowered.ranks)),  # recognised ones written
    ("buckets", _buckets),  # gradient reductions bucketed, started as the backward makes them
    ("reshard", _reshard),  # gathered weights (ZeRO-3), activations: freed, gathered again
    ("autograd regions", _autograd_regions),  # backward pieces run back to back: one call
    ("running sums", _running_sums),  # sums of many parts added up as the parts are made
    ("fold", _fold),  # a template's blocks run once per micro-batch
    ("overlap", _overlap),  # communication started early, NCCL-safe message order
    ("ring", _ring),  # keys and values for attention land run by run as it computes
    ("frees", _frees),  # each tensor freed after its last reader
]


def run_passes(lowered: Lowered) -> Code:
    """Every pass of ``PASSES`` in order, on ``lowered``'s code."""
    for _, run in PASSES:
        lowered.ranks = run(lowered)
    return lowered.ranks
