"""A run's loss curve, from its per-step records."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_losses(records: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Loss per step as a PNG, with the evaluation loss where the records have it, and the
    learning rate on a second axis when they have it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, [r["loss"] for r in records], color="tab:blue", label="loss")
    evaluated = [r for r in records if r.get("eval_loss") is not None]
    if evaluated:
        ax.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated],
                color="tab:red", marker="o", label="eval loss")
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if all(r.get("lr") is not None for r in records):
        lr = ax.twinx()
        lr.plot(steps, [r["lr"] for r in records], color="tab:gray", alpha=0.5, lw=1)
        lr.set_ylabel("learning rate", color="tab:gray")
    ax.set_title(title or f"loss over {len(records)} steps")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
