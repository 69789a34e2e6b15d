"""Co-shard: an attention or MLP cut into pieces that one device runs one after another."""

import pytest
import torch
from plan_testing import captured, trains_like_one_device

import chronotope as ct
from chronotope.compile.program import Assemble
from chronotope.graph.memory import PeakMemory
from chronotope.policies import mesh
from chronotope.runtime.local import run_in_threads


@pytest.mark.parametrize("name,kw", [
    ("gpt", dict(coshard=4)),  # one device
    ("llama", dict(tp=2, coshard=2)),  # n = C * |D| = 4 pieces, two per device
    ("bert", dict(dp=2, coshard=2, recompute="full")),
    ("swin", dict(tp=2, coshard=2)),  # q, k, v stacked and cut by heads; a bias table
])
def test_coshard_trains_like_one_device(name, kw):
    w, graph = captured(name)
    plan = mesh(graph, **kw)
    program = ct.compile(plan)
    if kw["coshard"] > 2:  # the parts' sums are added up as they are made
        assert any(isinstance(i, Assemble) and i.var.endswith("_partial") and len(i.parts) > 1
                   for i in program.ranks[0])
    trains_like_one_device(w, program, 2)


def test_coshard_parts_run_one_after_another_and_again_in_backward():
    _, graph = captured("gpt")
    plan = mesh(graph, tp=2, coshard=2)
    seq = plan.check().sequence(0)
    at = {op: i for i, op in enumerate(seq)}
    fc = [op for op in plan.leaves("linear_2")]  # the first MLP's column linear
    gelu = [op for op in plan.leaves("gelu")]
    assert {op.device for op in fc} == {0, 1} and len(fc) == 4
    mine = [op for op in fc if op.device == 0]
    # part 0 goes through the MLP before part 1 starts
    assert at[mine[0]] < at[[g for g in gelu if g.device == 0][0]] < at[mine[1]]
    assert all(op in plan.recomputed for op in fc + gelu)
    head = [op for op in graph if op.kind == "linear"][-1]  # read whole by the loss
    assert len(plan.leaves(head.name)) == 2 and not set(plan.leaves(head.name)) & plan.recomputed


@pytest.mark.parametrize("name,kw", [
    ("gpt", dict(block_size=512, n_layer=2, d_model=256, n_head=8, batch_size=2)),
    # each part's backward cut into several calls (where its q, k and v meet, at the bias
    # table both parts read): the forward still keeps only the part's inputs
    ("swin", dict(img_size=64, n_heads=(4, 8), batch_size=1)),
])
def test_coshard_keeps_fewer_activations_than_full_recompute(name, kw):
    w, graph = captured(name, **kw)
    plans = {"recompute": mesh(graph, recompute="full"), "coshard": mesh(graph, coshard=2)}
    estimated = {k: p.check().memory[0].activations for k, p in plans.items()}
    measured = {k: run_in_threads(ct.compile(p), w, 1, measure_memory=True).peak_memory[0]
                for k, p in plans.items()}
    assert estimated["coshard"] < estimated["recompute"], estimated
    assert measured["coshard"] < measured["recompute"], measured
    # what the estimate misses (the loss's working set) is no more under co-shard
    over = {k: measured[k] - estimated[k] for k in plans}
    assert over["coshard"] <= over["recompute"] + 0.05 * measured["recompute"], over


def test_coshard_needs_something_to_split():
    _, graph = captured("gpt")  # 4 heads, 256 MLP features
    with pytest.raises(ct.PlanError, match="splits 3 ways"):
        mesh(graph, coshard=3)
    with pytest.raises(ct.PlanError, match="coshard >= 1"):
        mesh(graph, coshard=0)


def test_peak_memory_counts_what_is_alive_at_once():
    x = torch.ones(1024)  # made before: not counted
    with PeakMemory() as watch:
        a = x * 2  # 4 KiB
        b = a + 1  # 8 KiB alive
        del a
        c = b.view(32, 32)  # a view: nothing new
        c.add_(1)  # in place: nothing new
        d = b * 3  # 8 KiB alive again
    assert watch.peak == 2 * 4096 and watch.live == 2 * 4096
    del b, c, d
    assert watch.live == 0
