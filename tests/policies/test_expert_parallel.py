"""Expert parallelism: each Mixture-of-Experts layer's experts shared out over groups of
data-parallel replicas, equal to one device."""

import math

import pytest
import torch
from plan_testing import trains_like_one_device

import chronotope as ct
from chronotope.compile.program import AllReduce, Exchange
from chronotope.errors import PlanError
from chronotope.graph.experts import routed_experts
from chronotope.graph.mask import covers_exactly_once
from chronotope.policies import ParallelConfig, make, mesh
from tests.zoo.harness import capture
from tests.zoo.models import FAMILIES

MOE = ("mixtral", "qwen2-moe", "deepseek-v3", "olmoe", "switch")
SHAPES = [dict(dp=2, ep=2), dict(dp=4, ep=4), dict(dp=4, ep=2), dict(dp=2, ep=2, tp=2),
          dict(dp=2, ep=2, tp=2, sequence=True), dict(dp=2, ep=2, cp=2)]


@pytest.mark.parametrize("family,shape", [
    (f, s) for f in MOE for s in SHAPES
    if not (f == "switch" and "cp" in s)],  # (its attention is no sdpa: cp is refused)
    ids=str)
def test_experts_shared_out_train_like_one_device(family, shape):
    trains_like_one_device(FAMILIES[family](), ct.compile(mesh(capture(FAMILIES[family]()),
                                                               **shape)))


@pytest.mark.parametrize("family", ["qwen2-moe", "deepseek-v3"])
@pytest.mark.parametrize("fold", [False, True])
def test_mixture_of_experts_layers_pipeline_over_micro_batches(family, fold):
    """Each micro-batch routes its own tokens and exchanges them with its group: no
    dispatch over the whole batch holds a pipeline back (a router's balancing loss over
    the whole batch does: mixtral's)."""
    graph = capture(FAMILIES[family]())
    plan = mesh(graph, dp=2, ep=2, pp=2, micro=2, schedule="1f1b", fold=fold)
    program = ct.compile(plan)
    assert any(isinstance(ins, Exchange) for code in program.ranks for ins in code)
    trains_like_one_device(FAMILIES[family](), program)
    with pytest.raises(PlanError, match="cannot run op div"):
        ct.policies.pipeline(capture(FAMILIES["mixtral"]()), 2, 2, "1f1b")


@pytest.mark.parametrize("shape", [dict(dp=4, ep=4), dict(dp=2, ep=2, tp=2), dict(tp=4)],
                         ids=str)
def test_each_device_keeps_its_share_of_the_experts(shape):
    """Expert parallelism gives each member its experts, tensor parallelism each device
    its part of every expert's hidden features: of gate and up side by side in one weight
    (Hugging Face's ``gate_up_proj``), its part of both."""
    graph = capture(FAMILIES["mixtral"]())
    checked = mesh(graph, **shape).check()
    share = shape.get("ep", 1) * shape.get("tp", 1)
    layer = "model.layers.0.mlp.experts."
    for key in (layer + "gate_up_proj", layer + "down_proj"):
        held = [checked.storage.stored[d][key] for d in range(len(checked.storage.stored))]
        assert all(sum(m.numel for m in masks) * share == graph.params[key].meta.numel
                   for masks in held), (key, held)
        assert covers_exactly_once([m for masks in held[:share] for m in masks],
                                   graph.params[key].shape)
    if "tp" in shape:  # device 1: the second part of the gate's rows and of the up's
        width = graph.params[layer + "down_proj"].shape[-1]
        part = width // shape["tp"]
        assert [m.index[1] for m in checked.storage.stored[1][layer + "gate_up_proj"]] == \
            [(part, 2 * part), (width + part, width + 2 * part)]
    else:  # what is not an expert's stays whole on each device
        name = "model.layers.0.self_attn.q_proj.weight"
        assert checked.storage.stored[0][name][0].index[0] == (0, graph.params[name].shape[0])


def test_what_expert_parallelism_cannot_share_out_is_refused_by_name():
    graph = capture(FAMILIES["mixtral"]())
    with pytest.raises(PlanError, match="ep that divides dp"):
        mesh(graph, dp=2, ep=4)
    with pytest.raises(PlanError, match="4 experts do not share out over 8"):
        mesh(graph, dp=8, ep=8)
    with pytest.raises(PlanError, match="no experts op to cut"):
        mesh(capture(FAMILIES["opt"]()), dp=2, ep=2)
    with pytest.raises(PlanError, match="does not read ep"):
        make(graph, ParallelConfig("tp", 2, ep=2))
    assert make(graph, ParallelConfig("dp", 4, ep=2)).ndevices == 4


def test_each_token_travels_to_the_experts_it_is_routed_to_alone(monkeypatch):
    """Mixtral's top 2 of 4 experts, one expert per device: a token goes to exactly two of
    the four devices, so each exchange moves between 1 and 2 rows per token to other
    devices (its own device may hold one of them), where sending them whole to every
    device of the group would move 3. A layer exchanges four times: its tokens with
    their routing and weights out, their outputs back, and the same for the gradients."""
    from chronotope.runtime.transport import ThreadTransport

    moved = []

    def counted(self, blocks, ranks, rank, async_op=False, counts=None):
        moved.append(sum(b.shape[0] for r, b in zip(ranks, blocks) if r != rank))
        return ThreadTransport.all_to_all(self, blocks, ranks, rank, async_op)

    monkeypatch.setattr(ThreadTransport, "all_to_all_rows", counted)
    graph = capture(FAMILIES["mixtral"]())
    program = ct.compile(mesh(graph, dp=4, ep=4))
    layers = sum(op.kind == "experts" for op in graph.ops)
    for code in program.ranks:
        assert sum(isinstance(ins, Exchange) for ins in code) == 4 * layers
    trains_like_one_device(FAMILIES["mixtral"](), program, steps=1)
    tokens = next(op for op in graph.ops if op.kind == "experts").inputs[0].shape[0]
    assert len(moved) == 4 * 4 * layers  # every rank's calls
    rows = sum(moved) / (4 * layers)
    assert tokens <= rows <= 2 * tokens, (rows, tokens)


def test_a_plan_file_keeps_which_experts_pieces_exchange_their_tokens(tmp_path):
    from chronotope.plan.files import load_plan, save_plan

    graph = capture(FAMILIES["qwen2-moe"]())
    path = tmp_path / "plan.json"
    save_plan(mesh(graph, dp=2, ep=2), path)
    program = ct.compile(load_plan(graph, path))
    assert any(isinstance(ins, Exchange) for ins in program.ranks[0])
    trains_like_one_device(FAMILIES["qwen2-moe"](), program, steps=1)


class OwnRouter(torch.nn.Module):
    """A model of one's own: a top-2 router over 8 experts, its experts one
    ``routed_experts`` call."""

    def __init__(self, d: int = 16, experts: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.gate = torch.nn.Parameter(torch.randn(experts, hidden, d) / d ** 0.5)
        self.up = torch.nn.Parameter(torch.randn(experts, hidden, d) / d ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, d, hidden) / hidden ** 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = routed_experts(x, index, weights, self.gate, self.up, self.down, 0, "silu")
        return torch.nn.functional.mse_loss((x + out).sum(-1), y)


def own_router() -> ct.Workload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return ct.Workload(OwnRouter(), (torch.randn(64, 16, generator=g),
                                     torch.randn(64, generator=g)), name="own-router")


@pytest.mark.parametrize("shape", [dict(dp=2, ep=2), dict(dp=4, ep=4), dict(dp=4, ep=2),
                                   dict(tp=2), dict(dp=2, ep=2, tp=2)], ids=str)
def test_a_router_of_ones_own_exchanges_its_tokens_like_one_device(shape):
    """Its experts shared out, and under tensor parallelism their hidden features too; each
    lane of a group exchanges its tokens with the same lane of the others."""
    graph = ct.capture(own_router())
    plan = mesh(graph, **shape)
    (experts,) = [op for op in graph.ops if op.kind == "experts"]
    pieces = plan.leaves(experts.name)
    assert {p.inputs[3].mask.index[1] for p in pieces} == \
        ({(0, 8), (8, 16)} if "tp" in shape else {(0, 16)})
    program = ct.compile(plan)
    if "tp" not in shape:  # (its tokens are cut along their features under tp: sent whole)
        assert any(isinstance(ins, Exchange) for ins in program.ranks[0])
    trains_like_one_device(own_router(), program)


class GivenRoute(OwnRouter):
    """Routing that comes with the batch: rank by rank, most tokens to experts 0 and 1, one
    to expert 6, and some second picks dropped (-1, as a router over capacity drops them)."""

    def forward(self, x: torch.Tensor, index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        weights = self.router(x).softmax(-1).gather(-1, index.clamp(min=0)) * (index >= 0)
        out = routed_experts(x, index, weights, self.gate, self.up, self.down, 0, "silu")
        return torch.nn.functional.mse_loss((x + out).sum(-1), y)


def given_route() -> ct.Workload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    index = torch.tensor([0, 1]).repeat(64, 1)
    index[::16, 0], index[5::16, 1] = 6, -1
    return ct.Workload(GivenRoute(), (torch.randn(64, 16, generator=g), index,
                                      torch.randn(64, generator=g)), name="given-route")


@pytest.mark.parametrize("shape", [dict(dp=4, ep=4), dict(dp=2, ep=2), dict(dp=4, ep=2),
                                   dict(dp=2, ep=2, tp=2)], ids=str)
def test_experts_sent_no_token_or_one_or_dropped_ones_train_like_one_device(shape):
    """Under ep 4 ranks 1 and 2 hold experts no token is routed to: they exchange no rows,
    and their experts' gradients are zeros; rank 3 gets one row from each rank."""
    trains_like_one_device(given_route(), ct.compile(mesh(ct.capture(given_route()), **shape)))


@pytest.mark.parametrize("sequence", [False, True])
def test_tensor_parallel_lanes_exchange_their_tokens_lane_by_lane(sequence):
    """dp 2 x ep 2 x tp 2: ranks 0, 1 are replica 0's lanes, 2, 3 replica 1's. Each lane's
    tokens go to the same lane of the other member and come back from it alone, one
    exchange per lane: a lane's part of each expert's output (its hidden features' share)
    is combined on its own lane, and the lanes then sum theirs in one all-reduce of the
    replica's tokens. Sent to every lane, each routed row would travel once per lane."""
    family = FAMILIES["mixtral"]
    plan = mesh(capture(family()), dp=2, ep=2, tp=2, sequence=sequence)
    program = ct.compile(plan)
    groups = [{ins.ranks for ins in code if isinstance(ins, Exchange)} for code in program.ranks]
    lane = [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert groups == [{g} for g in lane], groups
    if not sequence:  # the outputs, and the gradients of tokens and weights, summed over lanes
        replica = [(0, 1), (0, 1), (2, 3), (2, 3)]
        layers = sum(op.kind == "experts" for op in plan.graph.ops)
        for r, code in enumerate(program.ranks):
            summed = [k for ins in code if isinstance(ins, AllReduce) and ins.ranks == replica[r]
                      for k in ins.keys if k.via[:1] == (("lanes", replica[r][0]),)]
            assert len(summed) == 3 * layers, summed
    trains_like_one_device(family(), program, steps=1)


def test_the_simulator_prices_exchanges_as_the_rows_a_spreading_router_sends():
    """Top 2 of 4 experts, one per device of 4: a token reaches another device with the
    chance 1 - C(3, 2) / C(4, 2) = 1/2, which the traffic counts and the simulator prices."""
    from chronotope.compile.simulate import simulate
    from chronotope.cost.network import load_cluster

    program = ct.compile(mesh(capture(FAMILIES["mixtral"]()), dp=4, ep=4))
    exchanges = [ins for ins in program.ranks[0] if isinstance(ins, Exchange)]
    every_row = sum(math.prod(r.shape) * r.dtype.itemsize for ins in exchanges
                    for r in ins.recvs)
    assert program.traffic(0)["all_to_all"] == every_row // 2
    assert simulate(program, load_cluster("dgx-a100")).ranks[0].comm > 0
