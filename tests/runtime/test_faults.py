"""Faults found where they start: what can be checked before the work is, NaN in the data
is named as NaN, and a loss that is not finite stops every rank at its step (or skips it,
when asked)."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.policies import mesh
from chronotope.runtime.launch import WorkerError
from chronotope.runtime.train import train

pytestmark = pytest.mark.slow


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc(x), y)


def setup():
    torch.manual_seed(0)
    batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(4)]
    w = ct.Workload(Regression(), batches[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.compile(mesh(ct.capture(w), dp=2)), batches


def test_nan_in_the_data_is_named_as_nan():
    w, program, batches = setup()
    batches[2][0][1, 3] = math.nan
    with pytest.raises(WorkerError, match=r"batch 2 has NaN in .* \(at \(1, 3\)\)"):
        train(program, w, batches, 4)


def test_a_loss_that_is_not_finite_stops_every_rank_at_its_step_or_is_skipped():
    w, program, batches = setup()
    blowing_up = ct.Optim("sgd", 1e30)  # the first update makes every later loss infinite
    with pytest.raises(WorkerError, match=r"the loss is not finite at step 2 \(batches 1 to "
                                          r"1\): the run stops here"):
        train(program, w, batches, 4, blowing_up)
    result = train(program, w, batches, 4, blowing_up, skip_nonfinite=True)
    assert [r.get("skipped", False) for r in result.records] == [False, True, True, True]
    assert all(torch.isfinite(p).all() for p in result.params.values())
    # the first step's gradient norm, as plain PyTorch finds it on one device
    w.model.zero_grad()
    w.model(*batches[0]).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in w.model.parameters()])
    assert result.records[0]["grad_norm"] == pytest.approx(float(expected), rel=1e-5)


def test_what_can_be_checked_before_the_work_is(tmp_path):
    """A data file that does not load, a model with nothing to train and a batch size
    the factory cannot take are refused before any worker starts."""
    from chronotope.errors import ChronotopeError, ModelLoadError
    from chronotope.models import load_workload
    from tests.models.test_models import USER_FILE

    w, program, batches = setup()
    with pytest.raises(ModelLoadError, match="nosuch.py"):
        train(program, w, f"{tmp_path}/nosuch.py:batches", 2)
    for p in w.model.parameters():
        p.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frozen = ct.compile(mesh(ct.capture(w), dp=2))
    with pytest.raises(ChronotopeError, match="nothing to train: each of its 2 parameters is "
                                              "frozen"):
        train(frozen, w, batches, 2)
    with pytest.raises(ModelLoadError, match="takes no batch_size, so a batch size of 7"):
        load_workload(f"{USER_FILE}:make", batch_size=7)
