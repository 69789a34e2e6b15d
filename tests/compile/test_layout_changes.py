"""The compiler's searched layout changes: used where the cost model says they pay,
and the plans still train like one device."""

import math
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.compile import compile
from chronotope.compile.program import AllGather, Recv
from chronotope.cost.network import Link, load_cluster
from chronotope.errors import PlanError
from chronotope.policies import mesh
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim
from chronotope.runtime.reference import compare, train_reference
from tests.policies.plan_testing import captured, trains_like_one_device

# Two devices per node, a slow network and no latency: bytes across nodes decide.
SLOW_NETWORK = replace(load_cluster("dgx-a100"), name="2-per-node", per_node=2, nodes=4,
                       intra=Link(0.0, 300e9), inter=Link(0.0, 10e9), call=0.0)


@pytest.fixture(scope="module")
def gpt():
    return captured("gpt")


def test_stage_boundaries_across_nodes_send_halves_and_gather(gpt):
    """A tensor-parallel stage hands its replicated output to the next stage on another
    node: each rank sends half, and the next stage all-gathers (Megatron's scatter-gather)."""
    w, g = gpt
    plan = mesh(g, tp=2, pp=2, micro=2)
    rvd = compile(plan, cluster=SLOW_NETWORK)
    naive = compile(plan, comm="p2p")
    assert rvd.changes and not naive.changes
    boundary = [c for c in rvd.changes if {0, 1} <= set(c.path.src.devices)
                and {2, 3} <= set(c.path.dst.devices)]
    assert boundary and all([s.kind for s in c.path.steps] == ["chunk", "send", "all_gather"]
                            for c in boundary)
    halves = {c.box.numel // 2 for c in boundary}
    got = [math.prod(i.shape) for i in rvd.ranks[2] if isinstance(i, Recv) and i.src in (0, 1)]
    assert halves <= set(got)  # half of each boundary tensor crosses, the rest is gathered
    assert any(isinstance(i, AllGather) and i.ranks == (2, 3) for i in rvd.ranks[2])
    trains_like_one_device(w, rvd)


def test_hierarchical_reductions_train_like_one_device(gpt):
    w, g = gpt
    program = compile(mesh(g, tp=4), cluster=SLOW_NETWORK)
    assert any(len(c.path.steps) > 1 for c in program.changes)
    trains_like_one_device(w, program)


@pytest.mark.slow
def test_searched_changes_over_part_of_the_ranks_run_on_gloo(gpt):
    """Each process makes the groups a searched path's collectives run over."""
    w, g = gpt
    program = compile(mesh(g, tp=4), cluster=SLOW_NETWORK)
    assert {(0, 1), (2, 3)} <= set(program.groups)
    run = run_processes(program, w, 2, Optim("sgd", 0.1))
    diff = compare(run, train_reference(w, 2, Optim("sgd", 0.1)))
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff


def test_p2p_and_single_nodes_make_no_searched_changes(gpt):
    _, g = gpt
    plan = mesh(g, tp=2, pp=2, micro=2)
    assert not compile(plan).changes  # one DGX A100 node: messages are as cheap
    with pytest.raises(PlanError, match="unknown comm 'nccl'"):
        compile(plan, comm="nccl")


class PoolOne(nn.Module):
    """A normed stream read at one position of its sequence (a last-token or class-token
    pooling): the read lies inside one of the pieces the norm was cut into."""

    def __init__(self, position: int) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(32, 16), nn.LayerNorm(16)
        self.mix, self.head = nn.Linear(16, 16), nn.Linear(16, 3)
        self.position = position

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.mix(self.embed(ids)))
        return F.cross_entropy(self.head(h[:, self.position, :]), y)


@pytest.mark.parametrize("position", [0, 5, -1])
def test_a_read_of_one_position_of_a_split_sequence_trains_like_one_device(position):
    torch.manual_seed(0)
    w = ct.Workload(PoolOne(position), (torch.randint(0, 32, (4, 12)), torch.randint(0, 3, (4,))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    for plan in (mesh(graph, tp=2), mesh(graph, tp=2, sequence=True), mesh(graph, dp=2, tp=2)):
        trains_like_one_device(w, compile(plan))
