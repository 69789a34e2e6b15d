"""Pipeline parallelism: stages, micro-batches and a schedule, all from the primitives.

``pipeline`` cuts the model into stages by compute and the batch into
micro-batches (``mesh`` does the placing; with ``chunks`` > 1 each rank holds
that many stages: ``r, r + ranks, ...``, or for V-shaped schedules ``r`` and
``2 * ranks - 1 - r``). A schedule is the list of ``Step(kind, stage,
micro-batch)`` steps of one rank (``plan/steps.py``: kinds F, B and W), which also
says which stages the rank holds, and consecutive steps become ``plan.order``
calls between the rank's forward and backward micro-batch groups. A schedule
with ``W`` steps splits every backward into its input-gradient part (``B``)
and its weight-gradient part (``W``, see ``Plan.split_backward``). No schedule
is known to the compiler or the runtime.

``plan.steps.actions`` reads the order back as torch pipelining actions.
"""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from chronotope.errors import PlanError
from chronotope.plan.steps import Kind, Step

if TYPE_CHECKING:
    from chronotope.graph.ir import Graph
    from chronotope.plan import Plan



def gpipe(rank: int, ranks: int, micro: int, chunks: int = 1) -> list[Step]:
    """All forwards, then all backwards, in micro-batch order."""
    return [Step(Kind.F, rank, m) for m in range(micro)] + \
        [Step(Kind.B, rank, m) for m in range(micro)]


def one_f_one_b(rank: int, ranks: int, micro: int, chunks: int = 1) -> list[Step]:
    """Warm up with the forwards the later stages need, then alternate one forward and one
    backward, then drain the backwards: at most ``ranks - rank`` micro-batches live."""
    warmup = min(ranks - rank - 1, micro)
    steps = [Step(Kind.F, rank, m) for m in range(warmup)]
    for m in range(micro - warmup):
        steps += [Step(Kind.F, rank, warmup + m), Step(Kind.B, rank, m)]
    return steps + [Step(Kind.B, rank, m) for m in range(micro - warmup, micro)]


def interleaved(rank: int, ranks: int, micro: int, chunks: int) -> list[Step]:
    """Interleaved 1F1B (Megatron's virtual pipeline): rank ``r`` holds the ``chunks``
    stages ``r, r + ranks, ...``. Micro-batches pass through a rank's stages in rounds
    of ``ranks``, depth first; the warmup covers the other chunks of a round and two
    steps per rank still downstream, then one forward and one backward alternate."""
    rounds = max(1, micro // ranks)
    if micro % rounds:
        raise PlanError(f"interleaved 1F1B runs micro-batches in rounds of {micro // rounds}: "
                        f"{micro} micro-batches on {ranks} stages do not make whole rounds")
    per_round = micro // rounds
    total = chunks * micro
    warmup = min((chunks - 1) * per_round + 2 * (ranks - 1 - rank), total)
    done: dict[tuple[Kind, int], int] = defaultdict(int)
    steps: list[Step] = []

    def step(kind: Kind, chunk: int) -> None:
        stage = chunk * ranks + rank
        steps.append(Step(kind, stage, done[(kind, stage)]))
        done[(kind, stage)] += 1

    for i in range(total + warmup):
        if i < total:
            step(Kind.F, i // per_round % chunks)
        if i >= warmup:
            step(Kind.B, chunks - 1 - (i - warmup) // per_round % chunks)
    return steps


def zb1(rank: int, ranks: int, micro: int, chunks: int = 1) -> list[Step]:
    """Zero bubble (ZB-H1): 1F1B with each backward split in two, the weight gradients
    (W) left for the times a rank would wait. With equal F, B and W times the step
    takes ``3 * micro + ranks - 1`` of them (1F1B: ``3 * (micro + ranks - 1)``)."""
    if chunks != 1:
        raise PlanError(f"zb1 runs one stage per rank, not chunks={chunks}; zbv runs two")
    return _greedy(ranks, micro, (tuple(range(ranks)),), True, ranks + 1)[rank]


def zbv(rank: int, ranks: int, micro: int, chunks: int = 2) -> list[Step]:
    """Zero bubble, V-shaped (ZBV): two stages per rank, down the ranks and back up
    (rank 0 holds the first and the last), backwards split in input and weight parts,
    idle time filled with W."""
    if chunks != 2:
        raise PlanError(f"zbv runs two stages per rank (chunks=2), not chunks={chunks}")
    down = tuple(range(ranks))
    return _greedy(ranks, micro, (down + down[::-1],), True, 2 * (ranks + 1))[rank]


def chimera(rank: int, ranks: int, micro: int, chunks: int = 1) -> list[Step]:
    """Chimera: two pipelines over the same ranks, one down and one up, each with its own
    copy of the weights and half the micro-batches; rank ``r`` holds stage ``r`` of the
    down pipeline (steps' stage ``r``) and stage ``ranks - 1 - r`` of the up one (stage
    ``2 * ranks - 1 - r``). The two fill each other's bubbles."""
    if chunks != 1 or micro % 2:
        raise PlanError(f"chimera runs one stage of each direction per rank and an even "
                        f"number of micro-batches, not chunks={chunks}, micro={micro}")
    down = tuple(range(ranks))
    return _greedy(ranks, micro // 2, (down, down[::-1]), False, 2 * ranks)[rank]


def three_f_one_b(rank: int, ranks: int, micro: int, chunks: int) -> list[Step]:
    """3F1B (AlphaFold2 recycling): every micro-batch goes through the model ``chunks``
    times, the passes before the last without gradients (nothing kept, no backward),
    then the last with its backward. Pass ``k`` of stage ``s`` is step stage
    ``k * ranks + s``, on rank ``s``; the passes of other micro-batches fill the waits."""
    if chunks < 2:
        raise PlanError("3f1b needs a model that runs itself several times (recycling "
                        f"passes); this one runs {chunks} pass")
    down = tuple(range(ranks))
    return _greedy(ranks, micro, (down * chunks,), False, ranks,
                   (chunks - 1) * ranks)[rank]


@lru_cache(maxsize=64)
def _greedy(ranks: int, micro: int, chains: tuple[tuple[int, ...], ...], split: bool,
            limit: int, backward_from: int = 0) -> dict[int, list[Step]]:
    """Every rank's steps, by playing the pipeline with a forward's time as the unit (a
    whole backward takes two, each part of a split one takes one). Chain ``c`` runs
    ``micro`` micro-batches through its stages (``c * len(chain) + k`` on rank
    ``chain[k]``). A free rank runs a backward if one is ready (the latest in its chain
    first), else a forward if it keeps fewer than ``limit`` micro-batches' activations
    (until their W with ``split``, else their B), else its oldest waiting W. Stages
    before position ``backward_from`` of a chain run without gradients (no backward,
    nothing kept). Forwards are tried latest first, earliest first and oldest
    micro-batch first: the shortest play wins."""
    played = [_list_schedule(ranks, micro, chains, split, limit, first, backward_from)
              for first in _FORWARD_FIRST]
    done = [p for p in played if p is not None]
    if not done:
        raise PlanError(f"no schedule keeps at most {limit} micro-batches alive on each of "
                        f"{ranks} ranks with {micro} micro-batches")
    return min(done, key=lambda p: p[0])[1]


_FORWARD_FIRST = (lambda k, m: -k, lambda k, m: k, lambda k, m: (m, k))  # which ready forward


def _list_schedule(ranks: int, micro: int, chains: tuple[tuple[int, ...], ...], split: bool,
          limit: int, first: Callable[[int, int], object], backward_from: int
          ) -> tuple[int, dict[int, list[Step]]] | None:
    """One list schedule of ``_greedy`` (a unit-time simulation that picks each free rank's
    next step): its length and steps, or None when it gets stuck."""
    rank_of, position, nxt, prev = {}, {}, {}, {}
    for c, chain in enumerate(chains):
        for k, r in enumerate(chain):
            v = c * len(chain) + k
            rank_of[v], position[v] = r, k
            prev[v] = v - 1 if k else None
            nxt[v] = v + 1 if k + 1 < len(chain) else None
    held = {r: sorted((v for v in rank_of if rank_of[v] == r), key=lambda v: -position[v])
            for r in range(ranks)}
    ended: dict[Step, int] = {}
    forwards = dict.fromkeys(rank_of, 0)  # next micro-batch of each stage, F and B
    backwards = dict.fromkeys(rank_of, 0)
    waiting: dict[int, list[Step]] = {r: [] for r in range(ranks)}  # W steps, oldest first
    kept = [0] * ranks
    steps: dict[int, list[Step]] = {r: [] for r in range(ranks)}
    graded = {v for v in rank_of if position[v] >= backward_from}
    total = (len(rank_of) + (2 if split else 1) * len(graded)) * micro
    t = 0

    def ready(step: Step) -> bool:
        return step in ended and ended[step] <= t

    while len(ended) < total:
        if t > 4 * total:
            return None
        for r in range(ranks):
            if steps[r] and ended[steps[r][-1]] > t:
                continue  # busy
            step = next((Step(Kind.B, v, backwards[v]) for v in held[r] if v in graded
                         and backwards[v] < micro and ready(Step(Kind.F, v, backwards[v]))
                         and (nxt[v] is None or ready(Step(Kind.B, nxt[v], backwards[v])))),
                        None)
            if step is None and kept[r] < limit:
                step = min((Step(Kind.F, v, forwards[v]) for v in held[r]
                            if forwards[v] < micro and (prev[v] is None or ready(
                                Step(Kind.F, prev[v], forwards[v])))),
                           key=lambda s: first(position[s.stage], s.micro), default=None)
            if step is None and waiting[r]:
                step = waiting[r].pop(0)
            if step is None:
                continue
            kind, v, m = step
            if kind is Kind.F:
                forwards[v] += 1
                kept[r] += v in graded
            elif kind is Kind.B:
                backwards[v] += 1
                if split:
                    waiting[r].append(Step(Kind.W, v, m))
                else:
                    kept[r] -= 1
            else:
                kept[r] -= 1
            steps[r].append(step)
            ended[step] = t + (2 if kind is Kind.B and not split else 1)
        t += 1
    return max(ended.values()), steps


Schedule = Callable[[int, int, int, int], list[Step]]  # (rank, ranks, micro, chunks) -> steps


@dataclass(frozen=True)
class Order:
    """A schedule written down: each pipeline rank's steps, in the shape of the built-in
    ``family`` (which stages each rank holds, how many pipelines run, whether passes
    recycle), as the order search (``search/order.py``) or a CSV file gives them. It
    runs wherever a schedule's name does, for the plan it was made for."""

    family: str
    rows: dict[int, list[Step]]

    def __call__(self, rank: int, ranks: int, micro: int, chunks: int) -> list[Step]:
        if ranks != len(self.rows):
            raise PlanError(f"this {self.family} order has {len(self.rows)} pipeline ranks, "
                            f"the pipeline {ranks}")
        mine = self.rows[rank]
        (stages, runs), (shape, wanted) = map(_extent, (
            mine, SCHEDULES[self.family](rank, ranks, micro, chunks)))
        if (stages, runs) != (shape, wanted):
            raise PlanError(f"this {self.family} order runs stages {stages} x {runs} "
                            f"micro-batches on pipeline rank {rank}; {self.family} with {ranks} "
                            f"ranks, {micro} micro-batches and chunks={chunks} runs stages "
                            f"{shape} x {wanted} there")
        return mine

    def write(self, path: str) -> None:
        """As torch pipelining's CSV: one row of actions per rank (``read_schedule``)."""
        split = any(s.kind is Kind.W for row in self.rows.values() for s in row)
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([s.action(split) for s in self.rows[r]]
                                    for r in sorted(self.rows))


def _extent(steps: list[Step]) -> tuple[list[int], int]:
    """The stages a rank's steps run, and how many micro-batches."""
    return sorted({s for _, s, _ in steps}), max((m for _, _, m in steps), default=-1) + 1


SCHEDULES: dict[str, Schedule] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb1": zb1,
    "zbv": zbv,
    "chimera": chimera,
    "3f1b": three_f_one_b,
}
MULTI_STAGE = {"interleaved", "zbv"}  # schedules for ranks holding several stages (chunks)
DIRECTIONS = {"chimera": 2}  # schedules running the model in several pipelines at once
RECYCLING = {"3f1b"}  # schedules whose stages are the passes of a model that runs itself again
UNFOLDED = {*DIRECTIONS, *RECYCLING}  # run the model more than once a step: never folded


# Actions torch lists that are communication or gradient reduction: the compiler's own.
_DERIVED = re.compile(r"\d+(REDUCE_GRAD|UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B)\d*")


def read_schedule(path: str) -> tuple[Schedule, dict[int, list[Step]]]:
    """A schedule from torch pipelining's CSV: one row per rank of compute actions
    (``0F1``: stage 0, forward, micro-batch 1; ``1B0``: a backward; ``1I0`` and ``1W0``:
    its input and weight parts). Empty cells are idle steps; gradient reductions and
    communication are the compiler's, so they are skipped. Returns the schedule and its
    steps per rank."""
    rows: dict[int, list[Step]] = {}
    with open(path, newline="") as f:
        for rank, row in enumerate(csv.reader(f)):
            rows[rank] = []
            for cell in (c.strip() for c in row):
                if not cell:
                    continue
                if _DERIVED.fullmatch(cell):
                    continue
                step = Step.parse(cell)  # (I: the input part of a split backward, a B)
                if step is not None:
                    rows[rank].append(step)
                else:
                    raise PlanError(f"{path}: rank {rank}: cannot read action {cell!r}; "
                                    "expected a stage, F, B, I or W, and a micro-batch, "
                                    "like 0F1")
    if not rows:
        raise PlanError(f"{path}: no ranks in this schedule file")

    def schedule(rank: int, ranks: int, micro: int, chunks: int) -> list[Step]:
        if ranks != len(rows):
            raise PlanError(f"{path} has {len(rows)} ranks, the pipeline {ranks}")
        return rows[rank]
    return schedule, rows


def pipeline(graph: Graph, stages: int, microbatches: int, schedule: str | Schedule = "1f1b", *,
             dp: int = 1, tp: int = 1, chunks: int = 1, recompute: str | None = None,
             swap: str | None = None, fold: bool = False, cp: int = 1,
             cp_attention: str = "allgather", ep: int = 1) -> Plan:
    """``stages`` pipeline ranks (times ``cp`` context-parallel groups of ``tp``
    tensor-parallel devices each, times ``dp`` data-parallel groups) running
    ``microbatches`` micro-batches in ``schedule`` order; with ``chunks`` > 1
    (interleaved), each rank holds that many stages; ``recompute``, ``swap``, ``fold``
    (one micro-batch planned and compiled, all run), ``cp``, ``cp_attention`` and ``ep``
    as in ``mesh``."""
    from chronotope.policies.mesh import mesh

    return mesh(graph, dp, tp, pp=stages, micro=microbatches, schedule=schedule,
                chunks=chunks, recompute=recompute, swap=swap, fold=fold, cp=cp,
                cp_attention=cp_attention, ep=ep)
