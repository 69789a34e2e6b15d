"""What compute costs when it was measured: each op's forward and backward seconds
(``OpTime``, from ``measure.measure_ops``), a piece's share of them, and what the
runtime adds per instruction (``Calibration``, from ``measure.calibrate``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from chronotope.cost.compute import op_flops, piece_flops
from chronotope.plan.plan import PlanOp


@dataclass(frozen=True)
class OpTime:
    forward: float  # seconds
    backward: float  # seconds; 0 for an op without gradients to pass


def piece_seconds(piece: PlanOp, times: dict[str, OpTime]) -> float:
    """A forward or backward piece's share of its op's measured time, by FLOPs."""
    op = (piece.forward or piece).op
    measured = times[op.name]
    whole = op_flops(op) * (2 if piece.is_backward else 1)
    share = piece_flops(piece) / whole if whole else 1.0
    return (measured.backward if piece.is_backward else measured.forward) * share


@dataclass(frozen=True)
class Calibration:
    """What a step costs on this machine beyond its pieces' measured op times (scaled by
    ``compute_scale``: one op at a time with warm caches is not a step): the runtime's
    own work per instruction kind, per piece a backward call runs through, per byte
    an ``Assemble`` writes (None: the cluster's copy speed) and per parameter byte the
    optimizer updates (None: a few passes at the copy speed)."""

    compute_scale: float = 1.0
    overhead: dict[str, float] = field(default_factory=dict)  # seconds, by instruction kind
    per_piece: float = 0.0
    per_byte: float | None = None
    optimizer_per_byte: float | None = None

    def seconds(self, kind: str, pieces: int, nbytes: int, compute: float,
                copy_bandwidth: float) -> float:
        """An instruction of ``kind`` run on this rank (no communication) whose autograd
        call runs through ``pieces``, that writes ``nbytes`` and whose pieces' measured
        time is ``compute``."""
        per_byte = 1.0 / copy_bandwidth if self.per_byte is None else self.per_byte
        return (self.overhead.get(kind, 0.0) + self.per_piece * pieces + per_byte * nbytes
                + self.compute_scale * compute)
