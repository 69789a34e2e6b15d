"""Timelines of a plan's order: one lane per rank."""

from chronotope.viz.timeline import Bar, Timeline, timeline

__all__ = ["Bar", "Timeline", "timeline"]
