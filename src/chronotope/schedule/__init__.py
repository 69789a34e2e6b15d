"""The module schedule language: plans written module by module (``ct.schedule``)."""

from chronotope.schedule.schedule import (
    PRIMITIVES,
    Schedule,
    Subgraph,
    Verification,
    apply,
    schedule,
    schedule_primitive,
)
from chronotope.schedule.tune import Point, Tuning, tune

__all__ = ["PRIMITIVES", "Point", "Schedule", "Subgraph", "Tuning", "Verification", "apply",
           "schedule", "schedule_primitive", "tune"]
