"""The mesh policy's knobs searched: each point priced like the plan it builds, the knobs
chosen where they pay (16 bits, recompute, micro-batches) and their plans trained like one
device."""

import json
import warnings
from dataclasses import replace

import pytest
import torch
from search_testing import capture

import chronotope as ct
from chronotope.cli import main
from chronotope.compile.simulate import simulate
from chronotope.cost.network import cluster_for
from chronotope.models import get_workload
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.precision import BF16_TOLERANCE, Precision
from chronotope.runtime.reference import compare, train_reference
from chronotope.search import SearchError, search
from chronotope.search.knobs import Knobs, Model, points


def meta(name, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(get_workload(name, device="meta", **kw), check_up_to=0)


KNOBS = [Knobs(1, 1, 1, 1), Knobs(1, 8, 1, 1), Knobs(2, 4, 1, 4), Knobs(1, 1, 4, 8),
         Knobs(1, 2, 4, 8, recompute="full"), Knobs(1, 2, 4, 8, recompute="selective"),
         Knobs(1, 2, 4, 8, chunks=2), Knobs(1, 4, 2, 4, sequence=True),
         Knobs(2, 2, 2, 4, recompute="full", sequence=True), Knobs(1, 1, 8, 16, zero_bubble=True),
         Knobs(1, 2, 4, 16, recompute="full", zero_bubble=True), Knobs(1, 2, 4, 8, swap=True),
         Knobs(2, 4, 1, 4, swap=True), Knobs(8, 1, 1, 1, zero3=True),
         Knobs(4, 2, 1, 1, zero3=True), Knobs(4, 2, 1, 2, coshard=2),
         Knobs(2, 4, 1, 1, coshard=4, recompute="full")]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_each_point_is_priced_within_25_percent_of_its_plans_own_estimate(dtype):
    graph = meta("gpt3-1.3b", batch_size=16, n_layer=8)
    model = Model(graph, cluster_for(8, "dgx-a100"), dtype)
    for knobs in KNOBS:
        estimate = max(m.total for m in knobs.plan(graph, dtype).check().memory.values())
        assert 0.75 < model.price(knobs).memory / estimate < 1.25, knobs.label


def test_the_space_holds_every_degree_recompute_interleaving_and_sequence_parallelism():
    graph = meta("gpt3-1.3b", batch_size=16, n_layer=8)
    model = Model(graph, cluster_for(8, "dgx-a100"))
    space = list(points(model, 8, 8, replicas=True))
    assert {(k.dp, k.tp, k.pp) for k in space} >= {(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2)}
    assert {k.recompute for k in space} == {None, "selective", "full"}
    assert {k.chunks for k in space} == {1, 2, 4} and {k.sequence for k in space} == {False, True}
    assert all(k.devices == 8 and 16 % (k.dp * k.micro) == 0 for k in space)
    assert {k.schedule for k in space} == {"1f1b", "zb1", "interleaved"}
    assert {k.swap for k in space if k.recompute is None} == {False, True}  # a PCIe link
    assert [k for k in space if k.zero3] == [Knobs(8, 1, 1, 1, zero3=True),
                                             Knobs(4, 2, 1, 1, zero3=True),
                                             Knobs(2, 4, 1, 1, zero3=True)]
    assert {k.shard for k in space if k.dp > 1} == {False, True}
    # co-shard unfolded: without stages, context, experts or sequence parallelism
    assert {k.coshard for k in space} == {1, 2, 4}
    assert all(k.pp == k.cp == 1 and not k.sequence for k in space if k.coshard > 1)
    assert not any(k.shard for k in points(model, 8, 8))  # without replicas to shard over


def test_zero_bubble_fills_the_fill_and_drain_with_weight_gradients_at_a_memory_cost():
    graph = meta("gpt3-1.3b", batch_size=16, n_layer=8)
    model = Model(graph, cluster_for(8, "dgx-a100"), "bf16")
    plain, zb = (model.price(Knobs(1, 1, 8, 16, zero_bubble=z)) for z in (False, True))
    assert zb.seconds < plain.seconds and zb.memory > plain.memory
    w = get_workload("gpt", batch_size=8)
    plan = Knobs(1, 2, 2, 8, zero_bubble=True, recompute="full").plan(capture(w))
    assert plan.split  # backwards split into input and weight parts
    run = run_in_threads(ct.compile(plan), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)


def test_16_bit_training_is_priced_at_the_tensor_core_rate_and_in_half_the_activations():
    graph = meta("gpt3-1.3b", batch_size=16, n_layer=8)
    cluster = cluster_for(8, "dgx-a100")
    fp32 = search(graph, 8, cluster, method="mesh", simulate=False)
    bf16 = search(graph, 8, cluster, method="mesh", simulate=False, dtype="bf16")
    assert bf16.plan.dtype == "bf16" and fp32.plan.dtype == "fp32"
    assert bf16.predicted_step_s < fp32.predicted_step_s / 4


def test_gpt3_175b_fits_1024_a100s_in_16_bits_as_megatron_trains_it():
    graph = meta("gpt3-175b", batch_size=1536)
    cluster = cluster_for(1024, "dgx-a100x128")
    model = Model(graph, cluster, "bf16")
    priced = [model.price(k) for k in points(model, 1024, 8)]
    fitting = [p for p in priced if p.memory <= cluster.memory]
    assert fitting and all(p.knobs.tp <= 8 for p in priced)  # within a node
    best = min(fitting, key=lambda p: p.seconds)
    assert best.knobs.pp > 1 and best.knobs.tp > 1  # tensor parallel inside, pipeline across
    with pytest.raises(SearchError, match="the least any point of the space needs is about"):
        search(graph, 1024, cluster, method="mesh", memory=8 * 2 ** 30, simulate=False)


def test_when_memory_binds_the_search_recomputes_and_trains_like_one_device():
    w = get_workload("gpt", batch_size=8)
    graph = capture(w)
    cluster = cluster_for(2, "dgx-a100")
    model = Model(graph, cluster)
    priced = [model.price(k) for k in points(model, 2, 8)]
    without = min(p.memory for p in priced if p.knobs.recompute is None and not p.knobs.swap
                  and p.knobs.coshard == 1)  # co-shard makes its parts again too
    within = min(p.memory for p in priced if p.knobs.recompute is not None)
    assert within < without
    result = search(graph, 2, cluster, method="mesh", memory=(within + without) / 2)
    assert ("recompute" in result.mesh or "co-shard" in result.mesh) and result.plan.recomputed
    run = run_in_threads(ct.compile(result.plan), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)


def test_when_memory_binds_data_parallelism_accumulates_micro_batches_alike():
    w = get_workload("gpt", batch_size=8)
    graph = capture(w)
    cluster = cluster_for(2, "dgx-a100")
    model = Model(graph, cluster)
    dp = [model.price(k) for k in points(model, 2, 8)
          if k.dp == 2 and k.recompute is None and not k.sequence]
    whole = next(p.memory for p in dp if p.knobs.micro == 1)
    least = min(p.memory for p in dp)
    assert least < whole  # one micro-batch's activations live at a time
    knobs = min((p for p in dp if p.knobs.micro > 1), key=lambda p: p.memory).knobs
    run = run_in_threads(ct.compile(knobs.plan(graph)), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)


def test_a_16_bit_search_trains_like_one_device_under_autocast():
    w = get_workload("gpt", batch_size=8)
    result = search(capture(w), 2, method="mesh", dtype="bf16")
    assert result.plan.dtype == "bf16"
    run = run_in_threads(ct.compile(result.plan), w, 2, Optim("sgd", 0.1))  # the plan's dtype
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1),
                                        Precision("bf16"))).within(BF16_TOLERANCE)
    assert not compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)


def test_explain_says_the_layout_its_stages_what_binds_and_the_runners_up(capsys):
    assert main(["search", "gpt", "--devices", "4", "--method", "mesh", "--batch-size", "8",
                 "--dtype", "bf16", "--explain", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    why = report["explain"]
    assert report["dtype"] == why["dtype"] == "bf16" and why["layout"] == report["mesh"]
    assert why["binding"]["term"] in why["binding"]["bytes"] and why["binding"]["total"] > 0
    assert why["swapped_ops"] >= 0 and ("ZeRO-1" in why["storage"]) == (
        "optimizer state sharded" in why["layout"])
    assert why["runners_up"] and all(r["option"] != why["layout"] for r in why["runners_up"])
    assert main(["search", "gpt", "--devices", "4", "--method", "mesh", "--global-batch", "8",
                 "--explain"]) == 0
    text = capsys.readouterr().out
    assert "plan: dp" in text and "binding: device" in text and "runner-up:" in text


def test_interleaved_activations_alive_stop_growing_after_a_few_rounds():
    from chronotope.plan.steps import held_at_most
    from chronotope.policies.pipeline import SCHEDULES
    from chronotope.search.knobs import _alive, _order

    for pp, chunks, micro in [(2, 2, 40), (4, 4, 64), (8, 2, 96), (3, 4, 60)]:
        for rank in range(pp):
            order = SCHEDULES["interleaved"](rank, pp, micro, chunks)
            held = {s: 1.0 + s for s in range(rank, pp * chunks, pp)}  # stages unalike
            assert held_at_most(_order(rank, pp, micro, chunks), held) == \
                held_at_most(order, held)
            counts = _alive(rank, pp, micro, chunks, "interleaved")  # as one product
            assert (counts @ list(held.values())).max() == held_at_most(order, held)


@pytest.mark.parametrize("knobs", [Knobs(2, 2, 1, 2), Knobs(2, 1, 2, 2, recompute="full")],
                         ids=lambda k: k.label)
def test_data_parallelism_as_replicas_of_one_group_trains_like_one_device(knobs):
    w = get_workload("llama", batch_size=8)
    plan = knobs.plan(capture(w), replica=lambda r: capture(w.replica(r)))
    assert plan.replicas == 2 and plan.ndevices == knobs.tp * knobs.pp
    run = run_in_threads(ct.compile(plan), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)


@pytest.mark.slow
def test_when_optimizer_state_binds_the_search_shards_it_over_replicas_and_trains_alike():
    # one block, a vocabulary that dominates the weights: no pipeline to cut, and tensor
    # parallelism gathers the logits; what fits is data parallelism sharing Adam out
    # (a batch ZeRO-3's one micro-batch does not fit)
    w = get_workload("gpt", batch_size=16, n_layer=1, vocab_size=4096)
    graph = capture(w)
    cluster = cluster_for(4, "dgx-a100")
    model = Model(graph, cluster)
    priced = [model.price(k) for k in points(model, 4, 8, replicas=True)]
    sharded = min(p.memory for p in priced if p.knobs.shard)
    whole = min(p.memory for p in priced if not p.knobs.shard and not p.knobs.zero3)
    assert min(p.memory for p in priced if p.knobs.zero3) > whole
    assert sharded < whole
    result = search(graph, 4, cluster, method="mesh", memory=0.99 * whole,
                    replica=lambda r: capture(w.replica(r)))
    plan = result.plan
    assert "optimizer state sharded over dp" in result.mesh and plan.shard_optimizer
    assert plan.replicas > 1
    optim = Optim("sgd", 0.1)
    run = run_processes(ct.compile(plan), w, 2, optim)
    assert compare(run, train_reference(w, 2, optim)).within(1e-5)


def test_with_a_host_link_the_search_swaps_activations_and_trains_like_one_device():
    w = get_workload("gpt", batch_size=8)
    graph = capture(w)
    fast = replace(cluster_for(2, "dgx-a100"), host_bandwidth=1e18)  # swapping costs nothing
    model = Model(graph, fast)
    priced = [model.price(k) for k in points(model, 2, 8)]
    assert any(p.knobs.swap for p in priced)
    assert not any(k.swap for k in points(Model(graph, replace(fast, host_bandwidth=0.0)), 2, 8))
    kept = min(p.memory for p in priced if not p.knobs.swap and p.knobs.recompute is None)
    result = search(graph, 2, fast, method="mesh", memory=0.99 * kept, simulate=False)
    assert "swap" in result.mesh and result.plan.swapped
    run = run_in_threads(ct.compile(result.plan), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)
    # the simulator prices the copies over the host link
    plan = result.plan
    slow = replace(fast, host_bandwidth=1e6)
    assert simulate(ct.compile(plan, cluster=slow), slow).step_time > \
        simulate(ct.compile(plan, cluster=fast), fast).step_time


@pytest.mark.slow
def test_when_weights_bind_without_replicas_the_search_shards_them_zero_3_and_trains_alike():
    w = get_workload("gpt", batch_size=8, n_layer=1, vocab_size=4096)
    graph = capture(w)
    cluster = cluster_for(4, "dgx-a100")
    model = Model(graph, cluster)
    priced = [model.price(k) for k in points(model, 4, 8)]
    sharded = min(p.memory for p in priced if p.knobs.zero3)
    whole = min(p.memory for p in priced if not p.knobs.zero3)
    assert sharded < whole
    result = search(graph, 4, cluster, method="mesh", memory=0.99 * whole, simulate=False)
    assert "ZeRO-3" in result.mesh and result.plan.param_storage == "owned"
    optim = Optim("sgd", 0.1)
    run = run_processes(ct.compile(result.plan), w, 2, optim)
    assert compare(run, train_reference(w, 2, optim)).within(1e-5)


@pytest.mark.slow
def test_a_zero_3_point_with_tensor_parallel_replicas_trains_like_one_device_on_gloo():
    w = get_workload("gpt", batch_size=8, n_layer=1, vocab_size=4096)
    plan = Knobs(2, 2, 1, 1, zero3=True).plan(capture(w))
    assert plan.param_storage == "owned"
    optim = Optim("adamw", 1e-3)
    run = run_processes(ct.compile(plan), w, 2, optim)
    assert compare(run, train_reference(w, 2, optim)).within(1e-5)


def test_long_sequences_search_into_context_parallelism():
    """A sample of 16k tokens: no batch to share out, and what every layer keeps along
    the sequence binds; the space holds context-parallel groups (keys gathered round a
    ring, or heads all-to-all where they divide) and the search takes one."""
    graph = meta("gpt3-1.3b", batch_size=1, block_size=16384)
    model = Model(graph, cluster_for(8, "dgx-a100"), "bf16")
    assert model.contexts(8, 1) == [(1, "allgather")] + [
        (cp, way) for cp in (2, 4, 8) for way in ("ring", "ulysses")]
    assert (1, "allgather") in model.contexts(8, 8) and \
        (2, "ulysses") not in model.contexts(8, 16)
    whole, cut = (model.price(Knobs(1, 1, 1, 1, cp=cp)) for cp in (1, 4))
    assert cut.memory - cut.states < (whole.memory - whole.states) / 3
    # the ring's blocks land while attention computes: less waiting, the same memory
    ring = model.price(Knobs(1, 1, 1, 1, cp=4, attention="ring"))
    assert ring.seconds < cut.seconds and ring.memory == cut.memory
    result = search(graph, 8, "dgx-a100", method="mesh", dtype="bf16", simulate=False)
    assert " x cp " in result.mesh and result.plan.ndevices == 8


@pytest.mark.parametrize("knobs", [Knobs(1, 1, 1, 1, cp=2), Knobs(1, 1, 2, 2, cp=2),
                                   Knobs(2, 1, 1, 1, cp=2, attention="ulysses"),
                                   Knobs(1, 1, 2, 2, cp=2, attention="ring")],
                         ids=lambda k: k.label)
def test_context_parallel_points_train_like_one_device(knobs):
    w = get_workload("gpt", batch_size=4)
    run = run_in_threads(ct.compile(knobs.plan(capture(w))), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)


def test_experts_shared_out_are_points_priced_like_their_plans_and_train_alike():
    from tests.zoo.harness import capture as capture_family
    from tests.zoo.models import FAMILIES

    graph = capture_family(FAMILIES["mixtral"]())
    model = Model(graph, cluster_for(4, "dgx-a100"))
    assert model.sharing(4) == [1, 2, 4] and model.sharing(2) == [1, 2]
    assert Model(capture(get_workload("gpt")), cluster_for(4, "dgx-a100")).sharing(4) == [1]
    assert {k.ep for k in points(model, 4, 8)} == {1, 2, 4}
    priced = {ep: model.price(Knobs(4, 1, 1, 1, ep=ep)) for ep in (1, 2, 4)}
    assert priced[4].states < priced[2].states < priced[1].states  # 1 / ep of the experts
    for ep in (2, 4):
        knobs = Knobs(4, 1, 1, 1, ep=ep)
        estimate = max(m.total for m in knobs.plan(graph).check().memory.values())
        assert 0.75 < priced[ep].memory / estimate < 1.25, knobs.label
    run = run_in_threads(ct.compile(Knobs(4, 1, 1, 1, ep=2).plan(graph)), FAMILIES["mixtral"](),
                         2, Optim("sgd", 0.1))
    assert compare(run, train_reference(FAMILIES["mixtral"](), 2, Optim("sgd", 0.1))).within(1e-5)


def test_groups_sharing_their_experts_scale_as_replicas_of_one():
    from tests.graph.test_experts import TopOne

    torch.manual_seed(0)
    ids = torch.randint(0, 32, (8, 6))
    w = ct.Workload(TopOne(), (ids, ids.roll(1, 1)), name="top-one")
    plan = Knobs(4, 1, 1, 1, ep=2).plan(capture(w), replica=lambda r: capture(w.replica(r)))
    assert plan.replicas == 2 and plan.ndevices == 2  # a group of two sharing its experts
    run = run_in_threads(ct.compile(plan), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)
