"""Plans: partition (``trans``), place (``assign``) and order (``order``) ops, then check."""

from chronotope.plan.algo import Replicate, Split, ValueSplit
from chronotope.plan.check import CheckedPlan, Memory
from chronotope.plan.plan import BackwardOf, Group, Plan, PlanOp

__all__ = ["BackwardOf", "CheckedPlan", "Group", "Memory", "Plan", "PlanOp", "Replicate", "Split",
           "ValueSplit"]
