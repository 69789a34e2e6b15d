"""``compare``: every way a run can differ from one device counts as a mismatch."""

import math

import pytest
import torch

from chronotope.runtime.local import RunResult
from chronotope.runtime.reference import Difference, compare

LOSSES = [2.0, 1.5, 1.25, 1.0]


def params() -> dict[str, torch.Tensor]:
    return {"a.weight": torch.ones(3, 2), "a.bias": torch.zeros(3), "b.weight": torch.ones(4)}


def reference() -> RunResult:
    return RunResult(list(LOSSES), params())


def test_the_same_run_matches():
    diff = compare(reference(), reference())
    assert diff == Difference(0.0, 0.0) and diff.within(1e-5)


def test_a_small_difference_is_measured_against_the_scale():
    run = RunResult([2.0, 1.5, 1.25, 1.001], {**params(), "a.bias": torch.full((3,), 0.5)})
    diff = compare(run, reference())
    assert diff.max_loss_rel_diff == pytest.approx(1e-3) and diff.max_param_rel_diff == 0.5
    assert diff.within(0.5) and not diff.within(1e-3)


@pytest.mark.parametrize("step", range(len(LOSSES)))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_at_any_step_is_a_mismatch(step, bad):
    losses = list(LOSSES)
    losses[step] = bad
    for run, ref in ((RunResult(losses, params()), reference()),
                     (reference(), RunResult(losses, params()))):
        diff = compare(run, ref)
        assert not math.isfinite(diff.max_loss_rel_diff) and not diff.within(1e-5), diff


@pytest.mark.parametrize("name", list(params()))
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_parameter_anywhere_is_a_mismatch(name, bad):
    held = params()
    held[name][-1] = bad  # a region no rank assembled is NaN
    for run, ref in ((RunResult(list(LOSSES), held), reference()),
                     (reference(), RunResult(list(LOSSES), held))):
        diff = compare(run, ref)
        assert not math.isfinite(diff.max_param_rel_diff) and not diff.within(1e-5), diff


@pytest.mark.parametrize("losses", [[], LOSSES[:1], LOSSES[:-1], [*LOSSES, 0.5]])
def test_a_run_with_another_number_of_steps_is_a_mismatch(losses):
    diff = compare(RunResult(losses, params()), reference())
    assert diff.max_loss_rel_diff == math.inf and not diff.within(1e-5)


@pytest.mark.parametrize("held", [
    {n: p for n, p in params().items() if n != "a.bias"},
    {},
    {**params(), "c.weight": torch.ones(1)},
    {**params(), "b.weight": torch.ones(2, 2)},
], ids=["one-missing", "none", "one-extra", "other-shape"])
def test_parameters_that_do_not_line_up_are_a_mismatch(held):
    diff = compare(RunResult(list(LOSSES), held), reference())
    assert diff.max_param_rel_diff == math.inf and not diff.within(1e-5)
