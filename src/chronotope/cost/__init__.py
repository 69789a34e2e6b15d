"""The cost model: compute from op signatures or measured op times, and the alpha-beta
network model. Pure: measuring lives in ``chronotope.measure``, replaying programs on
these prices in ``chronotope.compile.simulate``."""

from chronotope.cost.compute import Traffic, op_flops, piece_flops
from chronotope.cost.times import Calibration, OpTime, piece_seconds

__all__ = ["Calibration", "OpTime", "Traffic", "op_flops", "piece_flops", "piece_seconds"]
