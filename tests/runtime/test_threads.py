"""Compiled plans, run as threads of one process, train exactly like one device."""

import builtins
import functools
import re
import warnings

import pytest

import chronotope as ct
from chronotope.compile import compile
from chronotope.compile.program import AllGather, AllReduce, Send
from chronotope.models import get_workload
from chronotope.policies import data_parallel, mesh, zero
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference

STEPS = 3


@functools.cache
def captured(name: str):
    w = get_workload(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


def split_linears(graph: ct.Graph, n: int) -> ct.Plan:
    """Every linear split on its output features, everything else replicated."""
    plan = ct.Plan(graph, n)
    for op in graph:
        split = op.kind == "linear" and op.inputs[1].shape[0] % n == 0
        for device, piece in enumerate(plan.trans(op, ct.Split("n", n) if split
                                                  else ct.Replicate(n))):
            plan.assign(piece, device)
    return plan


def assert_trains_like_one_device(plan: ct.Plan, workload) -> None:
    run = run_in_threads(compile(plan), workload, STEPS, Optim("sgd", 0.1))
    diff = compare(run, train_reference(workload, STEPS, Optim("sgd", 0.1)))
    assert len(run.losses) == STEPS
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff


@pytest.mark.parametrize("name", ["gpt", "llama", "bert", "t5", "swin", "evoformer",
                                  "hf-gpt2", "hf-bert"])
def test_data_parallel(name):
    workload, graph = captured(name)
    assert_trains_like_one_device(data_parallel(graph, 2), workload)


@pytest.mark.parametrize("name, n", [("gpt", 2), ("gpt", 4), ("llama", 2), ("bert", 4)])
def test_split_linears(name, n):
    workload, graph = captured(name)
    assert_trains_like_one_device(split_linears(graph, n), workload)


MESHES = {"tp2": (1, 2, False), "tp4": (1, 4, False), "sp2": (1, 2, True),
          "sp4": (1, 4, True), "dp2-tp2": (2, 2, False), "dp2-sp2": (2, 2, True)}


@pytest.mark.parametrize("shape", list(MESHES))
@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
def test_tensor_and_sequence_parallel(name, shape):
    workload, graph = captured(name)
    dp, tp, sequence = MESHES[shape]
    assert_trains_like_one_device(mesh(graph, dp, tp, sequence=sequence), workload)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
def test_zero(name, stage, n):
    workload, graph = captured(name)
    assert_trains_like_one_device(zero(graph, n, stage), workload)


def test_zero_shards_what_each_stage_promises():
    _, graph = captured("gpt")
    dp, z1, z2, z3 = (p.check().memory_of(0) for p in
                      (data_parallel(graph, 4), zero(graph, 4, 1), zero(graph, 4, 2),
                       zero(graph, 4, 3)))
    assert z1.optimizer < dp.optimizer / 3 and z1.grads == dp.grads and z1.params == dp.params
    assert z2.optimizer == z1.optimizer and z2.grads < dp.grads / 3 and z2.params == dp.params
    assert z3.params < dp.params / 3
    three = compile(zero(graph, 2, 3)).code(0)  # weights gathered where they are read
    assert "rt.all_gather(" in three and "rt.reduce_scatter(" in three
    assert "def refresh" not in three and "rt.send(" not in three
    two = compile(zero(graph, 2, 2)).code(1)  # one all-gather refreshes every copy
    assert "rt.reduce_scatter(" in two and "rt.all_gather(" not in two
    assert "def refresh(rt):\n" in two and two.count("rt.gather_params(") == 1


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
def test_zero_over_the_replicas_of_tensor_parallel_shards(name, stage):
    workload, graph = captured(name)
    assert_trains_like_one_device(zero(graph, 4, stage, tp=2), workload)


def test_zero_3_with_tensor_parallelism_gathers_each_shard_from_its_replicas():
    _, graph = captured("gpt")
    tp, z3 = (p.check().memory_of(0) for p in (mesh(graph, 2, 2), zero(graph, 4, 3, tp=2)))
    assert z3.params < 0.6 * tp.params and z3.optimizer < 0.6 * tp.optimizer
    code = compile(zero(graph, 4, 3, tp=2)).code(0)
    gathers = re.findall(r"rt\.all_gather\(\[[^\]]*\],\s*ranks=\(([0-9, ]+)\)", code)
    assert "0, 2" in gathers  # a tensor-parallel shard's runs, from its replicas alone
    assert "def refresh" not in code


@pytest.mark.parametrize("policy", ["dp", "tp", "zero-2", "zero-3"])
def test_gradients_clipped_by_the_global_norm(policy):
    workload, graph = captured("gpt")
    plan = {"dp": lambda: data_parallel(graph, 2), "tp": lambda: mesh(graph, 1, 2),
            "zero-2": lambda: zero(graph, 2, 2), "zero-3": lambda: zero(graph, 2, 3)}[policy]()
    optim = Optim("sgd", 0.1, clip=0.05)  # well below the gradients' norm: every step clips
    run = run_in_threads(compile(plan), workload, STEPS, optim)
    diff = compare(run, train_reference(workload, STEPS, optim))
    unclipped = compare(run, train_reference(workload, STEPS, Optim("sgd", 0.1)))
    assert diff.max_param_rel_diff <= 1e-5 < unclipped.max_param_rel_diff, (diff, unclipped)


@pytest.mark.parametrize("name, dp, tp, pp, micro", [
    ("gpt", 1, 1, 2, 2), ("llama", 2, 1, 1, 2), ("bert", 1, 2, 2, 2)])
def test_pipeline_stages_and_micro_batches(name, dp, tp, pp, micro):
    workload, graph = captured(name)
    plan = mesh(graph, dp, tp, pp=pp, micro=micro)
    if pp > 1:  # the first stage starts the second micro-batch before any backward
        first = [op.name for op in plan.check().sequence(0)]
        second_micro = min(i for i, n in enumerate(first) if n.startswith("embedding.1"))
        assert second_micro < min(i for i, n in enumerate(first) if n.endswith(".bw"))
    assert_trains_like_one_device(plan, workload)


def test_tensor_parallel_communicates_like_megatron():
    """One all-reduce after attention and one after the MLP, forward and backward;
    the fused q/k/v projection and the attention heads need no messages at all."""
    workload, graph = captured("gpt")
    layers = len(workload.model.h)
    code = compile(ct.policies.tensor_parallel(graph, 2)).ranks[0]
    reduces = [i for i in code if isinstance(i, AllReduce)]
    forward = [i for i in reduces if not i.vars[0].startswith("grad_")]
    assert len(forward) == 2 * layers
    assert all(i.keys[0].tensor.startswith("linear") for i in forward)  # row-parallel outputs
    # backward: where the column linears' input gradients meet (the lm_head's too); the
    # row linears' bias gradients are whole on every rank (each adds its share of the bias
    # to a partial sum, and an addend's gradient is the sum's), as in Megatron
    assert len(reduces) == 4 * layers + 1
    assert len([i for i in code if isinstance(i, AllGather)]) == 1  # the logits, for the loss
    assert len([i for i in code if isinstance(i, Send)]) == 1  # the tied embedding's gradient


def test_data_parallel_on_four():
    workload, graph = captured("gpt")
    assert_trains_like_one_device(data_parallel(graph, 4), workload)


def test_generated_code_is_readable_python_with_its_messages():
    workload, graph = captured("gpt")
    program = compile(split_linears(graph, 2))
    code = program.code(1)
    builtins.compile(code, "rank1.py", "exec")  # valid Python (the name compile is the plan's)
    assert code.startswith('"""Rank 1 of 2: one training step of gpt.')
    assert "rt.send(" in code and "rt.recv(" in code
    # piece 1 of h.0's first linear (op ``linear``), keyed by its module
    assert re.search(r"rt\.backward\(\s*\{[^}]*\},\s*\([^)]*'h\.0\.attn\.c_attn:1'", code)
    assert "# linear.1: linear  (gpt.py:" in code and "\n    del " in code


def test_a_dead_rank_is_named():
    workload, graph = captured("gpt")
    program = compile(data_parallel(graph, 2))
    program.ranks[1] = program.ranks[1][:5]  # rank 1 stops early: rank 0 waits on it
    with pytest.raises(Exception, match="rank 1"):
        run_in_threads(program, workload, 1, timeout=2)


def test_gradient_sums_become_all_reduces():
    workload, graph = captured("gpt")
    program = compile(data_parallel(graph, 2))
    traffic = program.traffic(0)
    # No message: rank 1's half of the loss, which rank 0 reports, rides in a bucket.
    assert traffic["p2p"] == 0 and program.groups == [(0, 1)]
    # one ring all-reduce of every gradient: 2 (k - 1) / k of the parameters' bytes
    assert traffic["all_reduce"] >= graph.num_params * 4
    code = program.code(0)
    assert code.count("rt.all_reduce(") <= 4  # loss sum and count, their gradients, all weights
