"""The stage DP: its cuts are the best by brute force, and the pipelines it finds train
like one device."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from search_testing import capture

import chronotope as ct
from chronotope.compile.program import AllReduce, Send
from chronotope.cost.network import cluster_for
from chronotope.errors import PlanError
from chronotope.graph.axes import batch_dims
from chronotope.models import get_workload
from chronotope.plan.algo import Split
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference
from chronotope.search import zero_weights
from chronotope.search.build import build_pipeline
from chronotope.search.space import strategies
from chronotope.search.stages import cut_positions, on_micro_batches, pipelines, stage_bounds


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=2, max_size=9), st.integers(1, 4), st.data())
def test_the_cuts_minimise_the_slowest_stage_as_brute_force_does(seconds, stages, data):
    cuts = data.draw(st.lists(st.integers(1, len(seconds) - 1), unique=True).map(sorted))
    if stages > len(cuts) + 1:
        return
    bounds = stage_bounds(seconds, cuts, stages)
    assert bounds[0] == 0 and bounds[-1] == len(seconds) and len(bounds) == stages + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert set(bounds[1:-1]) <= set(cuts)

    def slowest(bs):
        return max(sum(seconds[a:b]) for a, b in zip(bs, bs[1:]))

    best = min(slowest([0, *c, len(seconds)]) for c in itertools.combinations(cuts, stages - 1))
    assert slowest(bounds) == pytest.approx(best)


def test_stages_begin_between_blocks_where_only_the_residual_stream_crosses():
    graph = capture(get_workload("gpt", n_layer=4))
    cuts = cut_positions(graph)
    assert len(cuts) >= 4  # at least one before each block after the first
    modules = {graph.ops[i].source.module for i in cuts if graph.ops[i].source}
    assert {"h.1", "h.2", "h.3"} <= {m.split(".ln")[0] for m in modules}


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_every_pipeline_found_trains_like_one_device(model):
    w = get_workload(model, batch_size=8)
    graph = capture(w)
    found = pipelines(graph, 4, cluster_for(4), None)
    assert {(p.stages, p.stage_devices) for p in found} == {(2, 2), (4, 1)}
    assert [p.seconds for p in found] == sorted(p.seconds for p in found)
    for p in (found[0], next(p for p in found if p.stages == 4)):
        choice = {op: s for sol in p.solutions for op, s in sol.choice.items()}
        plan = build_pipeline(graph, p.stage_devices, p.stage_of, p.micro,
                              {op: s.algos for op, s in choice.items()},
                              zero=zero_weights(graph, choice))
        run = run_in_threads(ct.compile(plan), w, 4, Optim("sgd", 0.1))
        assert compare(run, train_reference(w, 4, Optim("sgd", 0.1))).within(1e-5), p.label

def test_a_weight_two_stages_read_is_read_as_data_parallel_and_reduced_once_over_both():
    """GPT's tied embedding: the embedding on the first stage, the projection on the last."""
    graph = capture(get_workload("gpt", batch_size=8))
    found = pipelines(graph, 4, cluster_for(4), None)[0]
    assert found.stages == 2
    wte = graph.params["wte.weight"]
    choice = {op: s for sol in found.solutions for op, s in sol.choice.items()}
    readers = [op for op in graph.ops if wte in op.inputs]
    assert len({found.stage_of[op] for op in readers}) == 2
    for op in readers:
        i = op.inputs.index(wte)
        assert set(choice[op].inputs[i]) == {"R"} and set(choice[op].grads[i]) == {"P"}
    plan = build_pipeline(graph, found.stage_devices, found.stage_of, found.micro,
                          {op: s.algos for op, s in choice.items()},
                          zero=zero_weights(graph, choice))
    program = ct.compile(plan)
    for code in program.ranks:
        assert not any(isinstance(i, Send) and "wte" in i.var for i in code)
        assert [i.ranks for i in code if isinstance(i, AllReduce)
                and "grad_wte_weight" in i.vars] == [(0, 1, 2, 3)]


def test_a_weight_a_stage_reads_transposed_keeps_stages_one_device_wide():
    """T5's output projection reads the shared embedding through a transpose, which cannot
    read it as data parallelism does: one-device stages, whose copies all-reduce it."""
    graph = capture(get_workload("t5", batch_size=8))
    found = pipelines(graph, 4, cluster_for(4), None)
    assert {(p.stages, p.stage_devices) for p in found} == {(4, 1)}
    choice = {op: s for sol in found[0].solutions for op, s in sol.choice.items()}
    plan = build_pipeline(graph, 1, found[0].stage_of, found[0].micro,
                          {op: s.algos for op, s in choice.items()})
    readers = {found[0].stage_of[op] for op in graph.ops
               if graph.params["shared.weight"] in op.inputs}
    for rank, code in enumerate(ct.compile(plan).ranks):
        assert [i.ranks for i in code if isinstance(i, AllReduce)
                and "grad_shared_weight" in i.vars] == ([tuple(sorted(readers))]
                                                        if rank in readers else [])


def test_micro_batch_spaces_keep_the_cuts_a_micro_batch_divides():
    graph = capture(get_workload("gpt", batch_size=8))
    space = strategies(graph, 4, cluster_for(4))
    kept = on_micro_batches(graph, space, 4)  # micro-batches of two: no batch cut by four
    batch = batch_dims(graph)

    def most_batch_cut(found):
        return {op: max(ss, key=lambda s: sum(a.parts for a in s.algos
                                              if isinstance(a, Split) and a.dim == batch[op])).algos
                for op, ss in found.items() if ss}

    stage_of = dict.fromkeys(graph.ops, 0)
    build_pipeline(graph, 4, stage_of, 4, most_batch_cut(kept))
    with pytest.raises(PlanError, match="does not split"):
        build_pipeline(graph, 4, stage_of, 4, most_batch_cut(space))
