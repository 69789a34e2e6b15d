"""Pipelines over micro-batches meet ops that need the whole batch: batch statistics, ops
that read the whole batch, a loss that is not a sum over samples. A built-in policy then
refuses the plan, naming the op, instead of producing one that deadlocks; with one
micro-batch the same pipeline trains like one device."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.policies import SCHEDULES, mesh
from tests.policies.plan_testing import trains_like_one_device


class Coupled(nn.Module):
    """Four linear layers (two pipeline stages) with one batch-coupled step in between."""

    def __init__(self, coupling: str) -> None:
        super().__init__()
        self.coupling = coupling
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, y):
        h = x
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if i == 1 and self.coupling == "center":  # batch statistics, as batch norm has
                h = h - h.mean(0, keepdim=True)
            if i == 1 and self.coupling == "sort":  # reads the whole batch
                h = h.sort(dim=0).values
        loss = F.mse_loss(h, y)
        return loss.pow(2) if self.coupling == "squared_loss" else loss


def captured(coupling: str):
    torch.manual_seed(0)
    w = ct.Workload(Coupled(coupling), (torch.randn(8, 8), torch.randn(8, 8)), name=coupling)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


CASES = {"center": "sum over the batch", "sort": "reads the whole batch",
         "squared_loss": "sum over the batch"}
PIPELINES = [s for s in SCHEDULES if s not in ("3f1b",)]


@pytest.mark.parametrize("coupling", list(CASES))
@pytest.mark.parametrize("schedule", PIPELINES)
def test_a_pipeline_refuses_to_cut_what_needs_the_whole_batch(coupling, schedule):
    _, graph = captured(coupling)
    chunks = 2 if schedule in ct.policies.MULTI_STAGE else 1
    with pytest.raises(ct.PlanError, match=CASES[coupling]) as error:
        mesh(graph, pp=2, micro=4, schedule=schedule, chunks=chunks)
    message = str(error.value)
    assert "micro=1" in message and "register_op" in message
    assert not isinstance(error.value, ct.DeadlockError)


@pytest.mark.parametrize("coupling", list(CASES))
def test_one_micro_batch_trains_like_one_device(coupling):
    w, graph = captured(coupling)
    trains_like_one_device(w, ct.compile(mesh(graph, pp=2, micro=1, schedule="1f1b")))


def test_per_sample_models_still_pipeline():
    w, graph = captured("none")
    trains_like_one_device(w, ct.compile(mesh(graph, pp=2, micro=4, schedule="1f1b")))
