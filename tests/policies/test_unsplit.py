"""A batch-splitting plan lists the ops it could not split along the batch (``plan.unsplit``):
each runs on the whole batch on every rank."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.policies import mesh, zero
from tests.zoo.models import FAMILIES


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        weights = torch.softmax(h, dim=0)  # over the batch
        g = torch.special.erfcx(h)  # no signature
        return self.b(g * weights + h).square().mean()


def captured(model: nn.Module | ct.Workload, *inputs: torch.Tensor) -> ct.Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(model, inputs)


def test_ops_that_lose_the_batch_are_listed_with_why():
    graph = captured(Mixed(), torch.randn(4, 6))
    why = {op.kind: reason for op, reason in mesh(graph, dp=2).unsplit.items()}
    assert why == {"special_erfcx": "no signature",
                   "softmax": "its signature cannot split that dim"}
    assert set(mesh(graph, dp=1, micro=2).unsplit) == set(mesh(graph, dp=2).unsplit)
    assert len(zero(graph, 2, 3).unsplit) == 2


def test_plans_that_split_no_batch_list_nothing():
    graph = captured(Mixed(), torch.randn(4, 6))
    assert mesh(graph, pp=2).unsplit == {} and ct.Plan(graph, 2).unsplit == {}


def test_a_cnn_with_batch_norm_and_pooling_splits_every_op_along_the_batch():
    graph = captured(FAMILIES["cnn-bn"]())
    assert graph.unannotated_ops() == []
    assert mesh(graph, dp=2).unsplit == {}


def test_a_shape_taken_from_the_batch_is_no_use_of_it():
    class Zeros(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.a(x), x.new_zeros(x.shape))

    assert mesh(captured(Zeros(), torch.randn(4, 6)), dp=2).unsplit == {}


def test_tensor_parallelism_that_would_split_nothing_is_refused_naming_the_widths(capsys):
    """tp 3 of a model whose projections are 64, 256 and 512 wide (q, k and v each 64)
    would replicate everything: refused, from the Python API and the command line."""
    from chronotope.cli import main
    from chronotope.errors import PlanError
    from tests.policies.plan_testing import captured

    _, graph = captured("gpt")
    with pytest.raises(PlanError, match=r"over 3 devices splits nothing in gpt: its "
                                        r"projections' output features do not divide by 3: "
                                        r"64 \(linear\), 256 \(linear_2\), 512"):
        mesh(graph, tp=3)
    assert main(["plan", "gpt", "--policy", "tp", "--devices", "3"]) == 2
    assert "splits nothing" in capsys.readouterr().err
    mesh(graph, tp=2)  # one that divides them
