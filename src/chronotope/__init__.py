"""chronotope: parallel training plans as small programs over a captured operator graph."""

from chronotope.errors import CaptureError, ChronotopeError, SignatureError, UnknownModelError
from chronotope.graph import (
    Graph,
    Mask,
    Op,
    PTensor,
    Signature,
    VTensor,
    capture,
    execute,
    register_op,
)
from chronotope.models.workload import Workload

__version__ = "0.1.0"

__all__ = [
    "CaptureError", "ChronotopeError", "Graph", "Mask", "Op", "PTensor", "Signature",
    "SignatureError", "UnknownModelError", "VTensor", "Workload", "capture", "execute",
    "register_op",
]
