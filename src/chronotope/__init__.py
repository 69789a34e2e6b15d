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
from chronotope.models.workload import Workload
from chronotope.plan import Plan, Replicate, Split, ValueSplit
from chronotope.plan.files import load_plan
from chronotope.runtime.checkpoint import consolidate, load_weights
from chronotope.runtime.launch import run_processes as run
from chronotope.runtime.optim import Optim
from chronotope.runtime.train import save, train
from chronotope.schedule import Schedule, schedule, schedule_primitive, tune
from chronotope.search import SearchResult, search

__version__ = "0.1.0"

__all__ = [
    "CaptureError", "ChronotopeError", "DeadlockError", "Graph", "Mask", "ModelLoadError", "Op",
    "PTensor", "Plan", "PlanError", "Replicate", "Schedule", "ScheduleError", "Signature",
    "SignatureError", "Split",
    "UnassignedOpError", "UnknownModelError", "VTensor", "Workload", "capture", "execute",
    "register_op", "Optim", "Program", "ValueSplit", "compile", "consolidate", "load_plan",
    "load_weights", "policies", "run", "save", "schedule", "schedule_primitive", "search",
    "SearchResult", "train", "tune",
]
