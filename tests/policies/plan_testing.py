"""What the policy tests share: a captured built-in model, and the one-device check."""

import warnings

import chronotope as ct
from chronotope.compile.program import Program
from chronotope.models import get_workload
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference
from chronotope.workload import Workload


def captured(name: str, **kw) -> tuple[Workload, ct.Graph]:
    w = get_workload(name, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


LOSS_FLOOR = 1e-4  # below it a loss is compared absolutely (see trains_like_one_device)


def trains_like_one_device(w: Workload, program: Program, steps: int = 2) -> None:
    """Losses and final weights within float32 tolerance of training on one device.

    A loss near zero that is the difference of much larger terms (the MSE of two nearly
    equal Gram matrices) carries the rounding of those terms: a relative difference of
    it says nothing, so losses below ``LOSS_FLOOR`` are held to 1e-5 of the floor.
    """
    run = run_in_threads(program, w, steps, Optim("sgd", 0.1))
    reference = train_reference(w, steps, Optim("sgd", 0.1))
    diff = compare(run, reference)
    assert diff.max_param_rel_diff <= 1e-5, diff
    assert len(run.losses) == len(reference.losses), diff
    assert all(abs(a - b) <= 1e-5 * max(abs(b), LOSS_FLOOR)
               for a, b in zip(run.losses, reference.losses)), diff
