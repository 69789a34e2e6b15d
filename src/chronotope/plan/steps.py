"""The steps of a template plan (``Plan.micro_batches``): when each device runs each
micro-batch's forward (F), backward (B) and weight-gradient (W) step of its stages.

A template holds micro-batch 0's pieces, grouped by stage in ``plan.cells``; every
other micro-batch runs the same pieces on its own rows. What a step of micro-batch
``m`` waits for is what the template's step waits for, in micro-batch ``m``: the
data edges between the template's cells say which. The steps are checked here as
``check`` checks a plan's orders: every step of a device's stages listed once, and
no device waiting for a step that can only come after its own next one.

``actions`` reads a plan's per-device order back as ``torch.distributed.pipelining``
actions (``"1F0"``: stage 1, forward, micro-batch 0; ``I`` and ``W`` for split
backwards), so orders compare step by step with torch's own schedules.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, NamedTuple

import numpy as np

from chronotope.errors import DeadlockError, PlanError
from chronotope.graph import rng
from chronotope.graph.convert import is_random
from chronotope.graph.ir import Op, PTensor
from chronotope.plan.plan import Plan, PlanOp, placed


class Kind(StrEnum):
    """What a pipeline step runs of its stage, for one micro-batch."""

    F = "F"  # the forward
    B = "B"  # the backward (its input-gradient part where a W step follows: action "I")
    W = "W"  # the weight-gradient part of a split backward


class Step(NamedTuple):
    """One step of a rank's pipeline schedule: ``kind`` of ``stage`` for micro-batch
    ``micro``. Schedules, a template's steps, pipeline actions and timelines use it."""

    kind: Kind
    stage: int
    micro: int

    def action(self, split: bool = False) -> str:
        """As torch pipelining writes it (``"1F0"``); with ``split`` (the schedule has W
        steps), a backward is its input-gradient part, ``I``."""
        kind = "I" if split and self.kind is Kind.B else self.kind.value
        return f"{self.stage}{kind}{self.micro}"

    @staticmethod
    def parse(action: str) -> Step | None:
        """The step a torch pipelining compute action names (``I`` read as ``B``); None
        for anything else (communication, gradient reduction, a malformed cell)."""
        found = _ACTION.fullmatch(action)
        if found is None or found.group(2) not in ("F", "B", "I", "W") or not found.group(3):
            return None
        kind = Kind.B if found.group(2) == "I" else Kind(found.group(2))
        return Step(kind, int(found.group(1)), int(found.group(3)))


_ACTION = re.compile(r"(\d+)([A-Z_]+)(\d*)")
Cell = tuple[Kind, int | str]  # (kind, stage): a template step (plan.cells's stages)


def cells_of(plan: Plan) -> dict[PlanOp, Cell]:
    """The template step each cell piece belongs to (forward leaves, their backward and
    weight-gradient parts); pieces of no cell run once per step, not per micro-batch."""
    out: dict[PlanOp, Cell] = {}
    for (_, stage, _), pieces in plan.cells.items():
        for piece in pieces:
            for leaf in plan.leaves(piece):
                out[leaf] = (Kind.F, stage)
                if (b := plan.backward_op(leaf)) is not None:
                    out[b] = (Kind.B, stage)
                if (w := plan.weight_op(leaf)) is not None:
                    out[w] = (Kind.W, stage)
    return out


def check_steps(plan: Plan, edges: list, cells: dict[PlanOp, Cell]) -> dict[int, int]:
    """Refuse steps that miss or repeat one of a device's steps, or that wait on each other
    in a cycle; returns, per device, the most micro-batches it keeps at once (forward run,
    backward not yet), which its activations take."""
    _refuse_what_differs(plan, cells)
    held: dict[int, set[Cell]] = defaultdict(set)
    for op, cell in cells.items():
        held[placed(op)].add(cell)
    for device, mine in held.items():
        want = {(k, s, m) for k, s in mine for m in range(plan.micro)}
        steps = plan.steps.get(device, [])
        given = set(steps)
        missing, unknown = sorted(want - given), sorted(given - want)
        if missing or unknown or len(steps) != len(given):
            what = f"{_shown(missing)} missing" if missing else \
                f"{_shown(unknown)} not on this device" if unknown else "a step twice"
            raise PlanError(f"the steps of device {device} do not fit the template: {what}; "
                            f"it runs {_shown(sorted(mine))} for micro-batches "
                            f"0..{plan.micro - 1}")
    _refuse_peers_apart(plan, held)
    # (device, cell) waits on (device, cell); one cell's pieces on several devices (tensor
    # parallel peers) run together, as the template does
    waits: set[tuple[int, Cell, int, Cell]] = set()
    for e in edges:
        a, b = cells.get(e.src), cells.get(e.dst)
        if a is not None and b is not None and a != b:
            waits.add((e.dst.device, b, e.src.device, a))
    _refuse_deadlock(plan, waits)
    return {device: kept(plan.steps[device]) for device in held}


def _refuse_peers_apart(plan: Plan, held: dict[int, set[Cell]]) -> None:
    """Devices that share a step (tensor-parallel peers) exchange within it: they must run
    the steps they share in one order."""
    first: dict[frozenset, int] = {}
    for device, mine in held.items():
        first.setdefault(frozenset(mine), device)
    for a, b in ((a, b) for a in first.values() for b in held if b != a):
        shared = held[a] & held[b]
        if not shared:
            continue
        ours, theirs = ([s for s in plan.steps.get(d, []) if s[:2] in shared] for d in (a, b))
        if ours != theirs:
            at = next(i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y)
            raise PlanError(f"devices {a} and {b} share steps {_shown(sorted(shared))} but "
                            f"run them in other orders: {_shown([ours[at]])} against "
                            f"{_shown([theirs[at]])}; run them in one order")


def _refuse_what_differs(plan: Plan, cells: dict[PlanOp, Cell]) -> None:
    """What micro-batch 0's pieces cannot do for the others: update buffers (each would
    set them), or draw on torch's own generator (the counter stream gives each micro-batch
    its rows' numbers; see ``graph/rng.py``)."""
    drawn = next((op for op in cells if not op.is_backward and is_random(op.op)
                  and not rng.drawn(op.op.target)), None)
    if drawn is not None:
        where = f" at {drawn.op.source}" if drawn.op.source else ""
        raise PlanError(f"a template runs micro-batch 0's pieces for every micro-batch, and "
                        f"{drawn.op.name} ({drawn.op.kind}{where}) draws random numbers from "
                        "torch's generator, not the counter stream: no micro-batch would "
                        "draw what one device does. Cut the micro-batches instead (fold=False)")
    per_micro = {op.op for op in cells if not op.is_backward}
    batched = [name for name, t in plan.graph.buffer_updates.items()
               if _made_from(t, per_micro)]
    if batched:  # a counter made from itself alone runs once, as one device runs it
        raise PlanError(f"a template runs micro-batch 0's pieces for every micro-batch, and "
                        f"the step updates buffers ({', '.join(batched)}) from the batch: "
                        "cut the micro-batches instead (fold=False)")


def _made_from(t: PTensor, ops: set[Op]) -> bool:
    """Whether ``t`` is computed from what any of ``ops`` makes."""
    seen, todo = set(), [t]
    while todo:
        op = todo.pop().producer
        if op is None or op in seen:
            continue
        if op in ops:
            return True
        seen.add(op)
        todo += op.inputs
    return False


def _refuse_deadlock(plan: Plan, waits: set[tuple[int, Cell, int, Cell]]) -> None:
    """A topological sweep of every micro-batch's steps: a device's steps in its order,
    each after the steps of the same micro-batch it ``waits`` for. A device left with a
    step when none can move is named with what it waits for. (Whether compiled code runs
    through is the replay engine's question, ``compile/replay.py``; this is the plan's.)"""
    before: dict[tuple[int, Cell], list[tuple[int, Cell]]] = defaultdict(list)
    for d, cell, src, other in waits:
        before[(d, cell)].append((src, other))
    done: set[tuple[int, str, int, int]] = set()
    at = dict.fromkeys(plan.steps, 0)
    moved = True
    while moved:
        moved = False
        for d, steps in plan.steps.items():
            while at[d] < len(steps):
                kind, stage, m = steps[at[d]]
                if any((src, k, s, m) not in done for src, (k, s) in before[(d, (kind, stage))]):
                    break
                done.add((d, kind, stage, m))
                at[d] += 1
                moved = True
    stuck = {d: steps[at[d]] for d, steps in plan.steps.items() if at[d] < len(steps)}
    if stuck:
        lines = ["the template's steps deadlock: each of these devices waits for a step "
                 "that cannot run before its own next one"]
        for d, (kind, stage, m) in sorted(stuck.items()):
            wanted = [f"{k}{s}.{m} on device {src}" for src, (k, s) in before[(d, (kind, stage))]
                      if (src, k, s, m) not in done]
            lines.append(f"  device {d}: {kind}{stage}.{m} waits for {', '.join(wanted[:3])}")
        lines.append("Order each device's steps so that a micro-batch's forward runs down the "
                     "stages and its backward back up.")
        raise DeadlockError("\n".join(lines))


def held_at_most(steps: Sequence[Step], held: Mapping[Any, float]) -> float:
    """The most bytes the stages' forwards keep at once as ``steps`` run (``held``: what
    one micro-batch's forward of each stage keeps), from a forward to the stage's last
    backward step of that micro-batch."""
    stages, counts = live_counts(steps)
    return max(0.0, float((counts @ np.array([held.get(s, 0) for s in stages],
                                             dtype=float)).max(initial=0.0)))


def live_counts(steps: Sequence[Step]) -> tuple[list[Any], np.ndarray]:
    """The stages ``steps`` run (sorted), and after each step how many micro-batches of
    each have run their forward and not their last backward step: a row per step, a
    column per stage (what ``held_at_most`` weighs by the bytes each keeps)."""
    stages = sorted({stage for _, stage, _ in steps})
    column = {stage: c for c, stage in enumerate(stages)}
    last = {(stage, m): i for i, (kind, stage, m) in enumerate(steps) if kind != "F"}
    counts = np.zeros((len(steps), len(stages)))
    live = np.zeros(len(stages))
    for i, (kind, stage, m) in enumerate(steps):
        if kind == "F":
            live[column[stage]] += 1
        elif last[(stage, m)] == i:
            live[column[stage]] -= 1
        counts[i] = live
    return stages, counts


def kept(steps: list[Step]) -> int:
    """The most micro-batches whose forward ran and whose last backward step has not."""
    last = {m: i for i, (kind, _, m) in enumerate(steps) if kind != "F"}
    alive, most = set(), 0
    for i, (kind, _, m) in enumerate(steps):
        if kind == "F":
            alive.add(m)
        elif last[m] == i:
            alive.discard(m)
        most = max(most, len(alive))
    return max(most, 1)


def _shown(steps: list) -> str:
    text = ", ".join("".join(map(str, s)) if len(s) == 2 else f"{s[0]}{s[1]}.{s[2]}"
                     for s in steps[:4])
    return text + (f" and {len(steps) - 4} more" if len(steps) > 4 else "")


def step_of(plan: Plan) -> dict[PlanOp, str]:
    """Each forward and backward piece a pipeline policy placed, as its action string
    (a split backward's parts: ``I`` and ``W``)."""
    out = {}
    for (_, s, m), pieces in plan.cells.items():
        split = any(plan.weight_op(leaf) for piece in pieces for leaf in plan.leaves(piece))
        for piece in pieces:
            for leaf in plan.leaves(piece):
                out[leaf] = f"{s}F{m}"  # (a stage may be a group's name: not a Step)
                back, weight = plan.backward_op(leaf), plan.weight_op(leaf)
                if back is not None:
                    out[back] = f"{s}{'I' if split else 'B'}{m}"
                if weight is not None:
                    out[weight] = f"{s}W{m}"
    return out


def _written(steps: list[Step]) -> list[str]:
    """Steps as action strings; a backward whose weight part is a step of its own is ``I``."""
    split = any(step.kind is Kind.W for step in steps)
    return [step.action(split) for step in steps]


def actions(plan: Plan) -> dict[int, list[str]]:
    """Per rank, its stage's forward / backward micro-batch steps in the order it runs them,
    as torch pipelining action strings (``"0F1"``, ``"1B0"``); ranks without stages are
    left out. A run of pieces of one step is one action."""
    if plan.micro > 1:  # a template: its steps are written down
        return {d: _written(steps) for d, steps in sorted(plan.steps.items()) if steps}
    steps_of = step_of(plan)
    checked = plan.check()
    out: dict[int, list[str]] = {}
    for rank in range(plan.ndevices):
        steps: list[str] = []
        for op in checked.sequence(rank):
            step = steps_of.get(op)
            if step is not None and (not steps or steps[-1] != step):
                steps.append(step)
        if steps:
            out[rank] = steps
    return out
