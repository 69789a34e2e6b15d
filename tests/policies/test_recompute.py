"""Recompute and swap: activations made again in backward or kept in CPU memory."""

import pytest
from plan_testing import captured, trains_like_one_device

import chronotope as ct
from chronotope.compile.program import Backward, Forward
from chronotope.policies import mesh, pipeline


@pytest.mark.parametrize("name,build", [
    ("gpt", lambda g: mesh(g, dp=2, recompute="full")),
    ("llama", lambda g: pipeline(g, 2, 2, "1f1b", recompute="full")),
    ("bert", lambda g: mesh(g, tp=2, recompute="selective")),
    ("gpt", lambda g: pipeline(g, 2, 4, "interleaved", chunks=2, recompute="selective")),
])
def test_recompute_trains_like_one_device(name, build):
    w, graph = captured(name)
    plan = build(graph)
    assert plan.recomputed
    trains_like_one_device(w, ct.compile(plan), 3)


def test_full_recompute_keeps_fewer_activations():
    _, graph = captured("gpt", n_layer=4, batch_size=8)
    kept = {how: pipeline(graph, 2, 4, "1f1b", recompute=how).check().memory[0].activations
            for how in (None, "full")}
    assert kept["full"] < kept[None] / 2


def test_recomputed_pieces_run_without_a_graph_then_again_in_backward():
    _, graph = captured("gpt")
    program = ct.compile(mesh(graph, dp=2, recompute="selective"))
    layers = sum(op.kind == "attention" for op in graph)
    code = program.ranks[0]
    # in the forward without a graph, then again with one inside its backward's call
    assert sum(isinstance(ins, Forward) and ins.recompute and ins.op.op.kind == "attention"
               for ins in code) == layers
    assert sum(isinstance(f, Forward) and f.op.op.kind == "attention"
               for ins in code if isinstance(ins, Backward) for f in ins.recompute) == layers
    text = program.code(0)
    assert "attention, recomputed in backward" in text and "with torch.no_grad():" in text


def test_recompute_names_forward_ops_only():
    _, graph = captured("gpt")
    plan = mesh(graph, dp=2)
    with pytest.raises(ct.PlanError, match="backward op: recompute its forward"):
        plan.recompute(plan.backward("linear"))
    with pytest.raises(ct.PlanError, match="unknown recompute policy 'some'"):
        mesh(graph, dp=2, recompute="some")


@pytest.mark.parametrize("name,build", [
    ("gpt", lambda g: mesh(g, dp=2, swap="full")),
    ("llama", lambda g: pipeline(g, 2, 2, "1f1b", swap="selective")),
])
def test_swapped_activations_train_like_one_device(name, build):
    w, graph = captured(name)
    plan = build(graph)
    assert plan.swapped and not plan.recomputed
    code = ct.compile(plan).code(0)
    assert "torch.autograd.graph.save_on_cpu(" in code
    trains_like_one_device(w, ct.compile(plan), 3)


def test_swap_keeps_fewer_activations_on_the_device():
    _, graph = captured("gpt", n_layer=4, batch_size=8)
    kept = {how: pipeline(graph, 2, 4, "1f1b", swap=how).check().memory[0].activations
            for how in (None, "full")}
    assert kept["full"] < kept[None] / 2


def test_an_op_is_recomputed_or_swapped_not_both():
    _, graph = captured("gpt")
    plan = mesh(graph, dp=2, recompute="selective")
    with pytest.raises(ct.PlanError, match="already recomputed or swapped"):
        plan.swap("scaled_dot_product_attention")
