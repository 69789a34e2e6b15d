"""Pipeline timelines: each rank's forward, backward and weight-gradient steps, in the
plan's order.

A step (``1F0``: stage 1's forward of micro-batch 0) lasts what its pieces cost
(``cost.piece_flops`` at ``flops_per_s``, or their share of each op's measured
time, ``cost.measure_ops``) and starts when its rank is free and
the steps it reads from have ended (data edges between the pieces; steps of the
same name on other ranks of a tensor-parallel group run alongside it). The
bubble ratio is the idle share of all ranks' time until the last step ends.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from chronotope.cost import OpTime, piece_flops, piece_seconds
from chronotope.errors import PlanError
from chronotope.plan import Plan
from chronotope.plan.check import data_edges
from chronotope.policies.pipeline import actions, step_of

# forward, backward, a split backward's input part and its weight part
COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#55a868", "W": "#dd8452"}


@dataclass(frozen=True)
class Bar:
    rank: int
    step: str  # "1F0", "1B0", "1I0", "1W0"; "HF0": a step of a group that is not one stage
    start: float  # seconds
    end: float

    @property
    def kind(self) -> str:
        return [c for c in self.step if c in COLORS][-1]


@dataclass
class Timeline:
    bars: list[Bar]
    ranks: list[int]

    @property
    def makespan(self) -> float:
        return max((b.end for b in self.bars), default=0.0)

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the ranks' time up to the last step's end."""
        busy = sum(b.end - b.start for b in self.bars)
        total = self.makespan * len(self.ranks)
        return 1 - busy / total if total else 0.0

    def save(self, path: str, title: str = "") -> None:
        """A PNG (matplotlib) or a self-contained HTML page (SVG), by the file's suffix."""
        if path.endswith(".html"):
            with open(path, "w") as f:
                f.write(self.html(title))
        elif path.endswith(".png"):
            self.png(path, title)
        else:
            raise PlanError(f"cannot write a timeline to {path}: use a .png or .html file")

    def png(self, path: str, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 0.5 * len(self.ranks) + 1.2))
        scale = 1e3  # milliseconds
        lane = {r: i for i, r in enumerate(self.ranks)}
        for b in self.bars:
            y = len(self.ranks) - 1 - lane[b.rank]
            ax.broken_barh([(b.start * scale, (b.end - b.start) * scale)], (y + 0.1, 0.8),
                           facecolors=COLORS[b.kind], edgecolor="white", linewidth=0.5)
            if b.end - b.start > self.makespan / 40:  # labels only where they fit
                ax.text((b.start + b.end) / 2 * scale, y + 0.5, b.step, ha="center",
                        va="center", fontsize=7, color="white")
        ax.set_yticks([len(self.ranks) - 1 - i + 0.5 for i in range(len(self.ranks))],
                      [f"rank {r}" for r in self.ranks])
        ax.set_xlabel("ms")
        ax.set_xlim(0, self.makespan * scale)
        ax.set_title(f"{title}  bubble {self.bubble_ratio:.0%}".strip())
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    def html(self, title: str) -> str:
        width, lane_h = 1000, 28
        scale = width / self.makespan if self.makespan else 1.0
        lane = {r: i for i, r in enumerate(self.ranks)}
        rects = []
        for b in self.bars:
            x, w, y = 70 + b.start * scale, (b.end - b.start) * scale, 10 + lane[b.rank] * lane_h
            tip = f"rank {b.rank} {b.step}: {b.start * 1e3:.3f}-{b.end * 1e3:.3f} ms"
            rects.append(f'<rect x="{x:.1f}" y="{y}" width="{max(w - 1, 0.5):.1f}" '
                         f'height="{lane_h - 4}" fill="{COLORS[b.kind]}"><title>{tip}</title>'
                         f'</rect><text x="{x + w / 2:.1f}" y="{y + lane_h / 2 + 2}" '
                         f'font-size="10" fill="white" text-anchor="middle">{b.step}</text>')
        labels = [f'<text x="0" y="{10 + i * lane_h + lane_h / 2 + 2}" font-size="12">rank {r}'
                  f'</text>' for r, i in lane.items()]
        height = 20 + len(self.ranks) * lane_h
        head = html.escape(f"{title}  bubble {self.bubble_ratio:.0%}".strip())
        return (f"<!doctype html><meta charset='utf-8'><title>{head}</title>"
                f"<h3 style='font-family:sans-serif'>{head}</h3>"
                f"<svg width='{width + 80}' height='{height}' font-family='sans-serif'>"
                + "".join(labels + rects) + "</svg>\n")


def timeline(plan: Plan, flops_per_s: float = 1e12,
             step_cost: Callable[[int, str], float] | None = None,
             measured: dict[str, OpTime] | None = None) -> Timeline:
    """The timeline of a pipeline plan (one made by ``policies.pipeline`` or ``mesh``).

    Durations are the pieces' FLOPs at ``flops_per_s``, their share of ``measured`` op
    times where given, or ``step_cost(rank, step)`` seconds where given (equal steps,
    to check a schedule's shape)."""
    order = actions(plan)
    if not order:
        raise PlanError("this plan has no pipeline steps to draw: make it with "
                        "ct.policies.pipeline (or mesh with pp > 1 and micro > 1)")
    steps = step_of(plan)
    checked = plan.check()
    ops = [op for seq in checked.sequences.values() for op in seq]
    cost: dict[tuple[int, str], float] = defaultdict(float)
    for op in ops:
        if op in steps:
            cost[(op.device, steps[op])] += piece_seconds(op, measured) if measured else \
                piece_flops(op) / flops_per_s
    if step_cost is not None:
        cost = defaultdict(float, {key: step_cost(*key) for key in cost})
    deps: dict[tuple[int, str], set[tuple[int, str]]] = defaultdict(set)
    for e in data_edges(ops):
        a, b = steps.get(e.src), steps.get(e.dst)
        if a is not None and b is not None and a != b:
            deps[(e.dst.device, b)].add((e.src.device, a))
    return Timeline(_simulate(order, cost, deps), sorted(order))


def _simulate(order: dict[int, list[str]], cost: dict, deps: dict) -> list[Bar]:
    """Each rank runs its steps in order, each as soon as what it reads has ended."""
    todo = {r: list(steps) for r, steps in order.items()}
    free = dict.fromkeys(order, 0.0)
    ended: dict[tuple[int, str], float] = {}
    bars = []
    while any(todo.values()):
        moved = False
        for r, steps in todo.items():
            while steps and all(d in ended for d in deps[(r, steps[0])]):
                key = (r, steps.pop(0))
                start = max([free[r], *(ended[d] for d in deps[key])])
                ended[key] = free[r] = start + cost[key]
                bars.append(Bar(r, key[1], start, ended[key]))
                moved = True
        if not moved:
            stuck = {r: steps[0] for r, steps in todo.items() if steps}
            raise PlanError(f"the pipeline order waits on itself at {stuck}")
    return bars
