"""From a checked plan to per-rank programs: materialize communication, generate code."""

from chronotope.compile.materialize import materialize
from chronotope.compile.program import Program
from chronotope.plan.plan import Plan


def compile(plan: Plan) -> Program:  # noqa: A001  (the public name ``ct.compile``)
    """Check ``plan`` and derive every rank's program, communication included."""
    return materialize(plan.check())


__all__ = ["Program", "compile", "materialize"]
