"""Frozen parameters (``requires_grad=False``) stay as they are under every policy: no
gradient, no optimizer state, no communication for them, as on one device."""

import re

import pytest
import torch

import chronotope as ct
from chronotope.policies import ParallelConfig, make, mesh
from chronotope.runtime.local import Optim, run_in_threads
from tests.policies.plan_testing import captured, trains_like_one_device

POLICIES = {
    "dp": ParallelConfig("dp", 2),
    "tp": ParallelConfig("tp", 2),
    "zero3": ParallelConfig("zero-3", 2),
    "1f1b": ParallelConfig("1f1b", 2, micro=2, fold=False),
}


def frozen_gpt(what: str):
    """The built-in GPT fine-tuned with its position table, or its first block, frozen."""
    w, _ = captured("gpt")
    modules = {"positions": w.model.wpe, "block": w.model.h[0]}
    modules[what].requires_grad_(False)
    frozen = {n for n, p in w.model.named_parameters() if not p.requires_grad}
    return w, ct.capture(w), frozen


@pytest.mark.parametrize("what", ["positions", "block"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_frozen_parameters_stay_fixed(policy, what):
    w, graph, frozen = frozen_gpt(what)
    assert {n for n, t in graph.params.items() if t.frozen} == frozen
    program = ct.compile(make(graph, POLICIES[policy]))
    for rank in range(program.ndevices):
        assert not frozen & set(program.owned[rank]), "frozen parameters have no update"
        code = program.code(rank)
        for name in frozen:  # no gradient is summed or handed to the optimizer
            assert not re.search(rf"rt\.grad\({name!r}", code)
            assert f"grad({name})" not in code and f"grad_{name.replace('.', '_')}" not in code
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    run = run_in_threads(program, w, 2, Optim("sgd", 0.1))
    for name in frozen:
        assert torch.equal(run.params[name], before[name]), name
    trains_like_one_device(w, program)


def test_a_frozen_parameter_has_no_update_to_plan():
    _, graph, frozen = frozen_gpt("positions")
    plan = ct.Plan(graph, 2)
    with pytest.raises(ct.PlanError, match="gets no gradient"):
        plan.update(next(iter(frozen)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
def test_a_frozen_first_stage_pipelines(schedule):
    """A stage that nothing trainable runs before has no backward: the schedule skips it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1))
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    w = ct.Workload(model, (torch.randn(4, 8),), loss_fn=lambda y: y.pow(2).mean())
    plan = mesh(ct.capture(w), pp=2, micro=2, schedule=schedule)
    trains_like_one_device(w, ct.compile(plan))
