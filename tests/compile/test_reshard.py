"""ZeRO-3 as FSDP2 reshards: a unit freed after its forward, gathered again for its backward."""

import warnings

import pytest
import torch
from torch import nn

import chronotope as ct
from chronotope.compile.program import (
    AllGather,
    Backward,
    Forward,
    Refill,
    Reshard,
    Wait,
    reads,
)
from chronotope.compile.reshard import is_regather
from chronotope.compile.simulate import simulate
from chronotope.cost.network import cluster_for
from chronotope.plan.storage import unit
from chronotope.policies import zero
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim
from chronotope.runtime.reference import compare, train_reference
from chronotope.workload import Workload
from tests.policies.plan_testing import captured, trains_like_one_device


@pytest.fixture(scope="module")
def gpt():
    return captured("gpt", n_layer=3, d_model=32, n_head=2, block_size=16, batch_size=8)


def units_of(code, at):
    """The module units of the pieces that read what the instruction at ``at`` gives."""
    names = set(code[at].vars)
    return {unit(ins.op.op) for ins in code if isinstance(ins, Forward) and names & set(ins.ins)}


def test_each_unit_is_freed_after_its_forward_and_gathered_again_one_unit_ahead(gpt):
    _, graph = gpt
    code = ct.compile(zero(graph, 2, stage=3)).ranks[0]
    freed = {i: ins for i, ins in enumerate(code) if isinstance(ins, Reshard)}
    refills = {i: ins for i, ins in enumerate(code) if isinstance(ins, Refill)}
    # every unit but the output head (its backward comes right after its forward): the tied
    # embedding ends the forward, so the position embedding, the blocks and ln_f are freed
    gathered = [units_of(code, i) for i, ins in enumerate(code)
                if isinstance(ins, Wait) and ins.vars and any(v in r.vars for r in freed.values()
                                                              for v in ins.vars)]
    assert sorted(map(sorted, gathered)) == [["h.0"], ["h.1"], ["h.2"], ["ln_f"], ["wpe"]]
    for at, r in freed.items():
        # no forward reads a freed tensor before it is refilled
        refill = next(i for i, x in refills.items() if x.vars == r.vars)
        assert not any(set(r.vars) & set(reads(x)) for x in code[at + 1:refill]
                       if not isinstance(x, (Refill, Reshard)))
        # ... and the backward of its readers runs after the refill
        readers = {x.op for x in code[:at] if isinstance(x, Forward) and set(r.vars) & set(x.ins)}
        first = min(i for i, x in enumerate(code) if isinstance(x, Backward)
                    and any(p.forward in readers for p in x.ops))
        assert at < refill < first
    # the units are gathered again in the order the backward needs them, each started
    # while the unit before it computes its backward (one ahead): the first when it begins
    regathers = [i for i, ins in enumerate(code) if is_regather(ins)]
    assert all(code[i].handle for i in regathers)
    order = sorted(refills)
    assert len(regathers) == len(order) == len(freed)
    assert regathers[0] < min(i for i, x in enumerate(code) if isinstance(x, Backward))
    assert all(order[k - 1] < regathers[k] < order[k] for k in range(1, len(order)))
    # one unit's backward at a time: no autograd call uses the weights of two freed units
    users = {x.op: unit(x.op.op) for x in code if isinstance(x, Forward)
             and any(set(r.vars) & set(x.ins) for r in freed.values())}
    for x in code:
        if isinstance(x, Backward):
            assert len({users[p.forward] for p in x.ops if p.forward in users}) <= 1


def test_resharding_trains_like_one_device_and_keeps_every_weight_fresh(gpt):
    """Over steps the weights change: what is gathered again must be this step's."""
    w, graph = gpt
    trains_like_one_device(w, ct.compile(zero(graph, 2, stage=3)), steps=3)


@pytest.mark.slow
def test_resharding_trains_like_one_device_on_gloo_processes(gpt):
    w, graph = gpt
    optim = Optim("sgd", 0.1)  # Adam makes a step of the rounding noise of zero gradients
    run = run_processes(ct.compile(zero(graph, 4, stage=3)), w, 3, optim)
    assert compare(run, train_reference(w, 3, optim)).within(1e-5)


class TransposedWeight(nn.Module):
    """A block that reads its weight through a view (``w.t()``): the view keeps pointing
    into the gathered storage, so that unit must never be freed."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x, y):
        x = x @ self.w.t()
        for block in self.blocks:
            x = torch.tanh(block(x))
        return nn.functional.mse_loss(x, y)


def test_a_unit_read_through_a_view_is_kept_and_the_rest_are_freed():
    torch.manual_seed(0)
    w = Workload(TransposedWeight(), (torch.randn(8, 16), torch.randn(8, 16)), name="transposed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    code = ct.compile(zero(graph, 2, stage=3)).ranks[0]
    freed = {v for ins in code if isinstance(ins, Reshard) for v in ins.vars}
    gathered = {k.tensor: var for ins in code if isinstance(ins, AllGather) and not is_regather(ins)
                for k, var in zip(ins.keys, ins.vars)}
    assert gathered["w"] not in freed
    assert {"blocks.0.weight", "blocks.1.weight"} <= {p for p, v in gathered.items()
                                                      if v in freed}
    trains_like_one_device(w, ct.compile(zero(graph, 2, stage=3)), steps=2)


def test_resharding_is_a_choice_kept_in_plan_files(gpt, tmp_path):
    _, graph = gpt
    kept = zero(graph, 2, stage=3, reshard=False)
    assert not any(isinstance(ins, (Reshard, Refill)) for ins in ct.compile(kept).ranks[0])
    for plan in (kept, zero(graph, 2, stage=3)):
        plan.save(str(tmp_path / "plan.json"))
        assert ct.load_plan(graph, tmp_path / "plan.json").reshard == plan.reshard


def test_the_simulator_prices_the_gathers_again(gpt):
    _, graph = gpt
    kept, resharded = (ct.compile(zero(graph, 2, stage=3, reshard=r)) for r in (False, True))
    assert resharded.traffic(0)["all_gather"] > kept.traffic(0)["all_gather"]
    cluster = cluster_for(2, "dgx-a100")
    times = [simulate(p, cluster).ranks[0] for p in (kept, resharded)]
    assert times[1].comm > times[0].comm and times[1].peak_memory < times[0].peak_memory
