"""An op with a constant operand (``x + 1``) is affine, not linear: cutting it along values
would add the constant once per piece."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.errors import PlanError
from chronotope.policies import mesh
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference


class Shifted(nn.Module):
    """A mean loss plus and minus constants: ops that take the batch's partial sums."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (F.mse_loss(self.lin(x), y) + 1.0) * 2.0 - 0.5


def captured() -> tuple[ct.Workload, ct.Graph]:
    torch.manual_seed(0)
    w = ct.Workload(Shifted(), (torch.randn(8, 4), torch.randn(8, 3)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


@pytest.mark.parametrize("micro", [1, 2])
def test_data_parallel_adds_a_constant_once(micro):
    w, graph = captured()
    run = run_in_threads(ct.compile(mesh(graph, dp=2, micro=micro)), w, 2, Optim("sgd", 0.1))
    diff = compare(run, train_reference(w, 2, Optim("sgd", 0.1)))
    assert diff.within(1e-5), diff


def test_value_split_refuses_an_op_with_a_constant_operand():
    _, graph = captured()
    plan = ct.Plan(graph, 2)
    shifted = next(op for op in graph if op.kind == "add")
    with pytest.raises(PlanError, match="linear"):
        plan.trans(shifted, ct.ValueSplit(2))
    scaled = next(op for op in graph if op.kind == "mul")
    assert len(plan.trans(scaled, ct.ValueSplit(2))) == 2  # x * 2 is linear
