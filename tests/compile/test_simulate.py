"""The simulator: a Program replayed on a cost model."""

from dataclasses import replace

import pytest
import torch
from torch import nn

import chronotope as ct
from chronotope.compile import compile
from chronotope.compile.program import AllReduce, Forward, Key, Load, Recv, Role, Send, Wait
from chronotope.compile.replay import replay
from chronotope.compile.simulate import _priced, _Prices, simulate
from chronotope.cost.compute import piece_flops
from chronotope.cost.network import Link, load_cluster
from chronotope.cost.times import Calibration
from chronotope.errors import PlanError
from chronotope.graph.mask import Mask
from chronotope.policies import mesh, pipeline
from tests.policies.plan_testing import captured

A100 = load_cluster("dgx-a100")
FREE_LINKS = replace(A100, name="free", intra=Link(0.0, 1e30), inter=Link(0.0, 1e30), call=0.0,
                     copy_bandwidth=1e30)


@pytest.fixture(scope="module")
def gpt():
    return captured("gpt")


def test_with_free_communication_data_parallel_is_its_compute(gpt):
    _, g = gpt
    sim = simulate(compile(mesh(g, dp=4), comm="p2p"), FREE_LINKS)
    assert sim.step_time == pytest.approx(max(r.compute for r in sim.ranks))
    assert all(r.comm == pytest.approx(0.0, abs=1e-12) for r in sim.ranks)
    one = simulate(compile(mesh(g, dp=1), comm="p2p"), FREE_LINKS)
    assert sim.step_time == pytest.approx(one.step_time / 4, rel=0.05)


def test_pipelines_wait_and_1f1b_keeps_less_memory(gpt):
    _, g = gpt
    # more micro-batches than stages: GPipe keeps all of them, 1F1B at most one per stage
    gpipe = simulate(compile(pipeline(g, 2, 4, "gpipe")), A100)
    f1b1 = simulate(compile(pipeline(g, 2, 4, "1f1b")), A100)
    assert 0 < gpipe.bubble_ratio < 1 and 0 < f1b1.bubble_ratio < 1
    assert max(r.peak_memory for r in f1b1.ranks) < max(r.peak_memory for r in gpipe.ranks)
    for sim in (gpipe, f1b1):
        for r in sim.ranks:
            assert r.compute + r.comm + r.bubble == pytest.approx(sim.step_time)


def test_slower_links_make_tensor_parallel_slower(gpt):
    _, g = gpt
    program = compile(mesh(g, tp=4))
    slow = replace(A100, name="slow", intra=Link(5e-6, 1e9))
    fast, slower = simulate(program, A100), simulate(program, slow)
    assert slower.step_time > fast.step_time
    assert max(r.comm for r in slower.ranks) > max(r.comm for r in fast.ranks)


def test_a_cluster_too_small_is_named(gpt):
    _, g = gpt
    with pytest.raises(PlanError, match="has 2 devices"):
        simulate(compile(mesh(g, dp=4), comm="p2p"), replace(A100, name="two", per_node=2))


def test_profiled_calls_after_compute_cost_what_they_were_measured_at(gpt):
    _, g = gpt
    program = compile(mesh(g, tp=2))
    measured = {kind: Link(1e-4, 1e9) for kind in ("send", "all_reduce", "all_gather")}
    slower = {kind: Link(5e-4, 1e9) for kind in measured}
    here = replace(FREE_LINKS, name="here", per_node=2, fitted=measured)
    back_to_back = simulate(program, here)
    after = simulate(program, replace(here, fitted_busy=slower, busy=1e-12))
    assert max(r.comm for r in after.ranks) > max(r.comm for r in back_to_back.ranks)
    assert after.step_time > back_to_back.step_time


def test_collectives_of_two_groups_crossing_nodes_share_the_network():
    """dp 2 x tp 2 on nodes of two: both tensor-parallel ranks' data-parallel all-reduces
    cross the nodes at once, so the node networks carry them one after the other."""
    torch.manual_seed(0)
    graph = ct.capture(ct.Workload(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)),
                                   (torch.randn(8, 16),), targets=(torch.randn(8, 1),),
                                   loss_fn=nn.functional.mse_loss, name="mlp"))
    slow_net = replace(A100, name="slow-net", nodes=2, per_node=2, inter=Link(1e-3, 1e6))
    program = compile(mesh(graph, dp=2, tp=2))
    crossing = {ins.ranks: slow_net.collective("all_reduce", _priced(ins, graph.params)[1],
                                               [ins.ranks])
                for code in program.ranks for ins in code
                if isinstance(ins, AllReduce) and len({slow_net.node(r) for r in ins.ranks}) > 1}
    assert set(crossing) == {(0, 2), (1, 3)}
    step = simulate(program, slow_net).step_time
    assert step >= sum(crossing.values())  # alone, each would take its own time at once


def test_communication_beside_compute_costs_what_the_cluster_cannot_overlap():
    """Rank 0 starts an all-reduce, computes, then waits for it. Where links and compute
    are apart (overlap 1) the step is the longer of the two; on CPUs, where both take the
    same cores (overlap 0), the compute during the transfer is paid again."""
    linear = captured("gpt")[1].op("linear")
    piece = ct.Plan(captured("gpt")[1], 1).op(linear.name)
    compute = Forward(piece, ("x",), ("y",), (False,), (False,))
    code = [Load("x", linear.inputs[0], Mask.full(linear.inputs[0].shape), "input"),
            AllReduce(("s",), (("x",),), (0, 1), (linear.inputs[0].shape,), torch.float32,
                      (Key("x", (), Role.VALUE),), handle="h"),
            compute, Wait("h", ("s",), unpack=True)]
    prices = dict(intra=Link(0.0, 1e6), fitted={}, call=0.0)
    times = {}
    for share in (1.0, 0.0):
        cluster = replace(A100, name=f"overlap {share}", per_node=2, overlap=share, **prices)
        played = replay([code, [code[0], code[1], code[3]]], _Prices(
            cluster, lambda op: piece_flops(op) / 1e9, {}, Calibration()))
        times[share] = played.clock[0]
    work = piece_flops(piece) / 1e9
    comm = cluster.collective("all_reduce", 4 * linear.inputs[0].meta.numel, [(0, 1)])
    assert work < comm
    assert times[1.0] == pytest.approx(comm)
    assert times[0.0] == pytest.approx(comm + work)


def test_a_message_ready_early_does_not_queue_behind_one_settled_before_it():
    """Rank 2 posts receives from ranks 0 and 1 and waits first for rank 0's, which
    computes before it sends; rank 1 sends at once. The replay settles rank 0's message
    first, yet rank 1's was ready long before: it crosses rank 2's port first, and rank 2
    is done one transfer after rank 0's send, not two."""
    linear = captured("gpt")[1].op("linear")
    piece = ct.Plan(captured("gpt")[1], 1).op(linear.name)
    x = linear.inputs[0]
    load = Load("x", x, Mask.full(x.shape), "input")
    whole = tuple(slice(0, n) for n in x.shape)
    cluster = replace(A100, name="slow port", per_node=3, intra=Link(0.0, 1e7), fitted={},
                      call=0.0)
    code = [[load, Forward(piece, ("x",), ("y",), (False,), (False,)),
             Send("x", whole, 2, 1)],
            [load, Send("x", whole, 2, 2)],
            [Recv("a", tuple(x.shape), torch.float32, 0, 1, handle="a"),
             Recv("b", tuple(x.shape), torch.float32, 1, 2, handle="b"),
             Wait("a", ("a",), unpack=False), Wait("b", ("b",), unpack=False)]]
    played = replay(code, _Prices(cluster, lambda op: piece_flops(op) / 1e8, {}, Calibration()))
    work = piece_flops(piece) / 1e8
    transfer = cluster.intra.seconds("send", 2, 4 * x.meta.numel)
    assert work > transfer > 0
    assert played.clock[2] == pytest.approx(work + transfer)
