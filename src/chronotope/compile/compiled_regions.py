"""Compiled regions: runs of local forward pieces that ``torch.compile`` compiles as one.

Two kinds: the pieces a plan fuses (``Plan.fuse``, a schedule's ``fuse``) form
regions of their fusion group, each compiled with the group's backend in the
generated code itself; under ``--compile``, every other run of pieces forms one
too, compiled with the run's backend.

A region is what a rank computes between two communications: its pieces become
one function, which ``torch.compile`` turns into one graph whose backward
AOTAutograd compiles too. Autograd must still see each piece's edges as the
plan has them, so a region holds only what stays exact as one autograd node:

* every leaf a piece enters (``rt.enter``: parameters, values from other ranks)
  is made before the region starts, so it is one of the function's inputs and
  ``torch.autograd.grad`` can reach it; a piece that enters a value made inside
  the region starts a new region;
* all its pieces' backwards run in one ``Backward`` call (the compiled node's
  backward runs once, for all of them);
* no piece draws random numbers, keeps its saved tensors in CPU memory, runs
  again in its backward, or has its weight gradients split off (those run eagerly).

Parameter and batch loads inside a run are made before the region; frees inside
it wait until it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chronotope.compile.program import (
    Assemble,
    Backward,
    Forward,
    Free,
    Instruction,
    Load,
    writes,
)
from chronotope.graph import rng
from chronotope.plan.plan import Fusion

MIN_PIECES = 2  # a lone op gains nothing from a graph of its own (unless fused by name)
FUNCTION = "forward_"  # region k is the generated function forward_<k>
FUSED = "fused_"  # ... or fused_<k>, compiled where it is defined


@dataclass
class Region:
    """Instructions run as one function: its ``loads`` are made before it, its ``body``
    runs inside it (in order), and what its frees name is freed once it has returned."""

    taken: list[Instruction] = field(default_factory=list)  # as they were, in order
    fusion: Fusion | None = None  # the fusion group it runs (None: a --compile run)

    @property
    def loads(self) -> list[Load]:
        return [ins for ins in self.taken if isinstance(ins, Load)]

    @property
    def body(self) -> list[Forward | Assemble]:
        return [ins for ins in self.taken if isinstance(ins, (Forward, Assemble))]

    @property
    def freed(self) -> list[str]:
        return [v for ins in self.taken if isinstance(ins, Free) for v in ins.vars]

    def pieces(self) -> list[Forward]:
        return [ins for ins in self.taken if isinstance(ins, Forward)]


def entered(ins: Forward) -> list[int]:
    """The inputs a piece makes something of before it runs (its shares, its autograd
    leaves): the names a region must already hold when the piece starts."""
    return [i for i in range(len(ins.ins))
            if ins.leaf(i) or (ins.input_shares and ins.input_shares[i] != 1)]


def compilable(ins: Forward) -> bool:
    return not (ins.recompute or ins.swap or any(ins.later) or rng.drawn(ins.op.op.target))


def compiled_regions(code: list[Instruction], rest: bool = True) -> list[Instruction | Region]:
    """``code`` with its fused pieces grouped into regions of their fusion group and, with
    ``rest``, its other runs of forward pieces too (runs of fewer than ``MIN_PIECES``
    unfused pieces stay as they were)."""
    backward_of = {op.forward_op.name: i for i, ins in enumerate(code)
                   if isinstance(ins, Backward) for op in ins.ops}
    out: list[Instruction | Region] = []
    run: Region | None = None
    made: set[str] = set()  # what the current region's body defines
    call: int | None = None  # the Backward call its pieces' backwards share

    def close() -> None:
        nonlocal run
        if run is not None:
            if run.fusion is not None or len(run.pieces()) >= MIN_PIECES:
                out.append(run)
            else:  # too short: as it was
                out.extend(run.taken)
        run = None

    for ins in code:
        if isinstance(ins, Forward) and (ins.fused is not None or rest and compilable(ins)):
            mine = backward_of.get(ins.op.name)
            starts_inside = any(ins.ins[i] in made for i in entered(ins))
            if run is None or starts_inside or run.fusion != ins.fused or (
                    mine is not None and call is not None and mine != call):
                close()
                run, made, call = Region(fusion=ins.fused), set(), None
            run.taken.append(ins)
            made.update(ins.outs)
            call = mine if mine is not None else call
        elif run is not None and (isinstance(ins, (Assemble, Free))
                                  or isinstance(ins, Load) and ins.source != "seed"):
            run.taken.append(ins)
            made.update(writes(ins) if isinstance(ins, Assemble) else ())
        else:
            close()
            out.append(ins)
    close()
    return out
