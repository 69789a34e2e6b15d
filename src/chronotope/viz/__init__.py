"""Pictures: timelines of a plan's order (one lane per rank), and loss curves."""

from chronotope.viz.losses import plot_losses
from chronotope.viz.timeline import Bar, Timeline, timeline

__all__ = ["Bar", "Timeline", "plot_losses", "timeline"]
