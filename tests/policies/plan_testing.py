"""What the policy tests share: a captured built-in model, and the one-device check."""

import warnings

import chronotope as ct
from chronotope.compile.program import Program
from chronotope.models import get_workload
from chronotope.models.workload import Workload
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference


def captured(name: str, **kw) -> tuple[Workload, ct.Graph]:
    w = get_workload(name, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


def trains_like_one_device(w: Workload, program: Program, steps: int = 2) -> None:
    """Losses and final weights within float32 tolerance of training on one device."""
    run = run_in_threads(program, w, steps, Optim("sgd", 0.1))
    diff = compare(run, train_reference(w, steps, Optim("sgd", 0.1)))
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff
