"""Pictures: timelines of a plan's order (one lane per rank), and loss curves."""

from chronotope.viz.losses import plot_losses
from chronotope.viz.timeline import save_timeline

__all__ = ["plot_losses", "save_timeline"]
