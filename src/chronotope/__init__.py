"""chronotope: parallel training plans as small programs over a captured operator graph."""

from chronotope import policies
from chronotope.compile import Program, compile
from chronotope.errors import (
    CaptureError,
    ChronotopeError,
    DeadlockError,
    ModelLoadError,
    PlanError,
    ScheduleError,
    SignatureError,
    UnassignedOpError,
    UnknownModelError,
)
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
from chronotope.plan import Plan, Replicate, Split, ValueSplit
from chronotope.plan.files import load_plan
from chronotope.runtime.launch import run_processes as run
from chronotope.runtime.optim import Optim, Rates
from chronotope.schedule import Schedule, schedule, schedule_primitive, tune
from chronotope.search import SearchResult, search
from chronotope.workload import Workload

__version__ = "0.1.0"

# Loaded when first used: torch.distributed.checkpoint (and the DTensor package it brings)
# takes about a second to import, which planning and ``--help`` need not pay.
_ON_DEMAND = {"consolidate": "chronotope.runtime.checkpoint",
              "load_weights": "chronotope.runtime.checkpoint",
              "save": "chronotope.runtime.train", "train": "chronotope.runtime.train",
              "placements": "chronotope.runtime.dtensors",
              "search_order": "chronotope.search.order",
              "to_dtensors": "chronotope.runtime.dtensors"}


def __getattr__(name: str) -> object:
    if name in _ON_DEMAND:
        import importlib

        return getattr(importlib.import_module(_ON_DEMAND[name]), name)
    raise AttributeError(f"module 'chronotope' has no attribute {name!r}")

__all__ = [
    "CaptureError", "ChronotopeError", "DeadlockError", "Graph", "Mask", "ModelLoadError", "Op",
    "PTensor", "Plan", "PlanError", "Replicate", "Schedule", "ScheduleError", "Signature",
    "SignatureError", "Split",
    "UnassignedOpError", "UnknownModelError", "VTensor", "Workload", "capture", "execute",
    "register_op", "Optim", "Program", "Rates", "ValueSplit", "compile", "consolidate", "load_plan",
    "load_weights", "placements", "policies", "run", "save", "to_dtensors", "schedule",
    "schedule_primitive", "search", "search_order",
    "SearchResult", "train", "tune",
]
