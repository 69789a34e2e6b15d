"""Pipeline timelines drawn: one lane per rank, its steps coloured by kind (forward,
backward, a split backward's input and weight parts) and messages under them, in grey.
The timeline itself is ``compile.timeline``."""

from __future__ import annotations

import html

from chronotope.compile.timeline import Timeline
from chronotope.errors import PlanError

# forward, backward, a split backward's input part and its weight part, communication
COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#55a868", "W": "#dd8452", "C": "#999999"}


def save_timeline(drawn: Timeline, path: str, title: str = "") -> None:
    """A PNG (matplotlib) or a self-contained HTML page (SVG), by the file's suffix."""
    if path.endswith(".html"):
        with open(path, "w") as f:
            f.write(_html(drawn, title))
    elif path.endswith(".png"):
        _png(drawn, path, title)
    else:
        raise PlanError(f"cannot write a timeline to {path}: use a .png or .html file")


def _png(drawn: Timeline, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.5 * len(drawn.ranks) + 1.2))
    scale = 1e3  # milliseconds
    lane = {r: i for i, r in enumerate(drawn.ranks)}
    for b in drawn.bars:
        y = len(drawn.ranks) - 1 - lane[b.rank]
        box = (y + 0.05, 0.2) if b.message else (y + 0.3, 0.65)
        ax.broken_barh([(b.start * scale, (b.end - b.start) * scale)], box,
                       facecolors=COLORS[b.kind], edgecolor="white", linewidth=0.5)
        if not b.message and b.end - b.start > drawn.makespan / 40:  # labels that fit
            ax.text((b.start + b.end) / 2 * scale, y + 0.62, b.step, ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks([len(drawn.ranks) - 1 - i + 0.5 for i in range(len(drawn.ranks))],
                  [f"rank {r}" for r in drawn.ranks])
    ax.set_xlabel("ms")
    ax.set_xlim(0, drawn.makespan * scale)
    ax.set_title(f"{title}  bubble {drawn.bubble_ratio:.0%}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

def _html(drawn: Timeline, title: str) -> str:
    width, lane_h = 1000, 28
    scale = width / drawn.makespan if drawn.makespan else 1.0
    lane = {r: i for i, r in enumerate(drawn.ranks)}
    rects = []
    for b in drawn.bars:
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
    height = 20 + len(drawn.ranks) * lane_h
    head = html.escape(f"{title}  bubble {drawn.bubble_ratio:.0%}".strip())
    return (f"<!doctype html><meta charset='utf-8'><title>{head}</title>"
            f"<h3 style='font-family:sans-serif'>{head}</h3>"
            f"<svg width='{width + 80}' height='{height}' font-family='sans-serif'>"
            + "".join(labels + rects) + "</svg>\n")

