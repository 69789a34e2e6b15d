"""Cost estimates: compute from op signatures, or measured per op on this machine."""

from chronotope.cost.compute import op_flops, piece_flops
from chronotope.cost.measure import Calibration, OpTime, calibrate, measure_ops, piece_seconds

__all__ = ["Calibration", "OpTime", "calibrate", "measure_ops", "op_flops", "piece_flops",
           "piece_seconds"]
