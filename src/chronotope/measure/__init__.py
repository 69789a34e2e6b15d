"""Measuring on this machine what the cost model needs: collectives and links
(``profile``), each op's time (``measure_ops``) and what the runtime adds to them
(``calibrate``). These run the runtime; the cost model itself (``cost``) does not."""

from chronotope.measure.calibrate import calibrate
from chronotope.measure.ops import measure_ops
from chronotope.measure.profile import profile, save_profile

__all__ = ["calibrate", "measure_ops", "profile", "save_profile"]
