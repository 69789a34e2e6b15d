"""Cost estimates: compute from op signatures, or measured per op on this machine."""

from chronotope.cost.compute import op_flops, piece_flops
from chronotope.cost.measure import OpTime, measure_ops, measure_overhead, piece_seconds

__all__ = ["OpTime", "measure_ops", "measure_overhead", "op_flops", "piece_flops", "piece_seconds"]
