"""Pipeline timelines: each rank's forward, backward and weight-gradient steps, in the
plan's order.

A step (``1F0``: stage 1's forward of micro-batch 0) lasts what its pieces cost
(``cost.piece_flops`` at ``flops_per_s``, or their share of each op's measured
time, ``measure.measure_ops``) and starts when its rank is free and
the steps it reads from have ended (data edges between the pieces; steps of the
same name on other ranks of a tensor-parallel group run alongside it), plus,
with ``bytes_per_s``, the time the bytes it reads from another rank take on
the link (drawn under the rank's steps, in grey). The bubble ratio is the idle
share of all ranks' compute time until the last step ends.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from chronotope.cost import OpTime, piece_flops, piece_seconds
from chronotope.errors import PlanError
from chronotope.plan import Plan
from chronotope.plan.check import Sources
from chronotope.policies.pipeline import actions, step_of

# forward, backward, a split backward's input part and its weight part, communication
COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#55a868", "W": "#dd8452", "C": "#999999"}


@dataclass(frozen=True)
class Bar:
    rank: int
    step: str  # "1F0", "1B0", "1I0", "1W0"; "HF0": a step of a group that is not one stage
    start: float  # seconds
    end: float
    message: bool = False  # bytes arriving for ``step`` (it names the step that sent them)

    @property
    def kind(self) -> str:
        return "C" if self.message else [c for c in self.step if c in COLORS][-1]


@dataclass
class Timeline:
    bars: list[Bar]
    ranks: list[int]

    @property
    def makespan(self) -> float:
        return max((b.end for b in self.bars), default=0.0)

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the ranks' time up to the last step's end (messages do not count:
        they travel while the rank computes)."""
        busy = sum(b.end - b.start for b in self.bars if not b.message)
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
            box = (y + 0.05, 0.2) if b.message else (y + 0.3, 0.65)
            ax.broken_barh([(b.start * scale, (b.end - b.start) * scale)], box,
                           facecolors=COLORS[b.kind], edgecolor="white", linewidth=0.5)
            if not b.message and b.end - b.start > self.makespan / 40:  # labels that fit
                ax.text((b.start + b.end) / 2 * scale, y + 0.62, b.step, ha="center",
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
            what = f"message to {b.step}" if b.message else b.step
            tip = f"rank {b.rank} {what}: {b.start * 1e3:.3f}-{b.end * 1e3:.3f} ms"
            top, high = (y + lane_h - 8, 5) if b.message else (y, lane_h - 10)
            label = "" if b.message else (
                f'<text x="{x + w / 2:.1f}" y="{y + lane_h / 2 - 1}" font-size="10" '
                f'fill="white" text-anchor="middle">{b.step}</text>')
            rects.append(f'<rect x="{x:.1f}" y="{top}" width="{max(w - 1, 0.5):.1f}" '
                         f'height="{high}" fill="{COLORS[b.kind]}"><title>{tip}</title>'
                         f'</rect>{label}')
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
             measured: dict[str, OpTime] | None = None,
             bytes_per_s: float | None = None) -> Timeline:
    """The timeline of a pipeline plan (one made by ``policies.pipeline`` or ``mesh``).

    Durations are the pieces' FLOPs at ``flops_per_s``, their share of ``measured`` op
    times where given, or ``step_cost(rank, step)`` seconds where given (equal steps,
    to check a schedule's shape). ``bytes_per_s``: the link speed messages between
    ranks take (None: they take no time)."""
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
    wire: dict[tuple, float] = defaultdict(float)  # (reader step, sender step) -> seconds
    sources = Sources(ops)
    for op in ops:  # the data edges between the pieces, as between steps
        b = steps.get(op)
        for v in op.inputs:
            for p, held in sources.find(v, op.device):
                a = steps.get(p)
                if a is None or b is None or a == b:
                    continue
                deps[(op.device, b)].add((p.device, a))
                common = held.intersect(v.mask)
                if bytes_per_s and p.device != op.device and common:
                    wire[((op.device, b), (p.device, a))] += \
                        common.numel * v.ptensor.dtype.itemsize / bytes_per_s
    return Timeline(_simulate(order, cost, deps, wire), sorted(order))


def _simulate(order: dict[int, list[str]], cost: dict, deps: dict, wire: dict) -> list[Bar]:
    """Each rank runs its steps in order, each as soon as what it reads has ended and
    travelled (``wire``: seconds on the link per reader and sender step)."""
    todo = {r: list(steps) for r, steps in order.items()}
    free = dict.fromkeys(order, 0.0)
    ended: dict[tuple[int, str], float] = {}
    bars = []
    while any(todo.values()):
        moved = False
        for r, steps in todo.items():
            while steps and all(d in ended for d in deps[(r, steps[0])]):
                key = (r, steps.pop(0))
                arrive = {d: ended[d] + wire.get((key, d), 0.0) for d in deps[key]}
                start = max([free[r], *arrive.values()])
                ended[key] = free[r] = start + cost[key]
                bars.append(Bar(r, key[1], start, ended[key]))
                bars += [Bar(r, key[1], ended[d], t, message=True)
                         for d, t in arrive.items() if t > ended[d]]
                moved = True
        if not moved:
            stuck = {r: steps[0] for r, steps in todo.items() if steps}
            raise PlanError(f"the pipeline order waits on itself at {stuck}")
    return bars
