"""Cost estimates: compute from op signatures (communication and profiles to come)."""

from chronotope.cost.compute import op_flops, piece_flops

__all__ = ["op_flops", "piece_flops"]
