"""The module schedule language: plans written module by module (``ct.schedule``)."""

from chronotope.schedule.schedule import (
    PRIMITIVES,
    Schedule,
    Subgraph,
    Verification,
    schedule,
    schedule_primitive,
)

__all__ = ["PRIMITIVES", "Schedule", "Subgraph", "Verification", "schedule",
           "schedule_primitive"]
