"""Gradient reductions in buckets, started while the rest of the backward runs."""

import math

import pytest

import chronotope as ct
from chronotope.compile.program import (
    AllGather,
    AllReduce,
    Backward,
    Loss,
    Recv,
    ReduceScatter,
    Send,
    sums_gradients,
)
from chronotope.errors import PlanError
from chronotope.policies import data_parallel, mesh, zero
from tests.policies.plan_testing import captured, trains_like_one_device


@pytest.fixture(scope="module")
def gpt():
    return captured("gpt", n_layer=2, d_model=32, n_head=2, block_size=16, batch_size=8)


def gradient_reductions(code):
    """Reductions of gradients (one may carry the loss too)."""
    return [(i, ins) for i, ins in enumerate(code) if isinstance(ins, (AllReduce, ReduceScatter))
            and any(sums_gradients((k,)) for k in ins.keys)]


def test_small_buckets_start_during_the_backward_and_hold_every_gradient_once(gpt):
    w, graph = gpt
    cap = 0.01  # MiB: a few small gradients, or one large one, per bucket
    program = ct.compile(data_parallel(graph, 2), bucket_mb=cap)
    code = program.ranks[0]
    found = gradient_reductions(code)
    last_backward = max(i for i, ins in enumerate(code) if isinstance(ins, Backward))
    assert sum(i < last_backward for i, _ in found) >= 5
    for _, ins in found:
        sizes = [math.prod(s) * 4 for s, k in zip(ins.shapes, ins.keys)
                 if sums_gradients((k,))]  # and the loss, riding in the last
        assert len(sizes) == 1 or sum(sizes) <= cap * 2**20
    keys = [k for _, ins in found for k in ins.keys if sums_gradients((k,))]
    assert len(keys) == len(set(keys)) == len(graph.params)
    trains_like_one_device(w, program)


def test_a_model_smaller_than_a_bucket_reduces_in_one_call_after_the_backward(gpt):
    """Every weight's gradient, the tied embedding's made last and the position
    embedding's (whose copies each run their backward on their rank's share of its
    output's gradient) included, in one call after the backward, as DDP's one bucket."""
    _, graph = gpt
    code = ct.compile(data_parallel(graph, 2)).ranks[1]
    found = gradient_reductions(code)
    last_backward = max(i for i, ins in enumerate(code) if isinstance(ins, Backward))
    assert len(found) == 1 and last_backward < found[0][0]
    assert {k.tensor for k in found[0][1].keys if sums_gradients((k,))} == {
        f"grad({p})" for p in graph.params}


@pytest.mark.parametrize("make", [
    lambda g: mesh(g, dp=2, tp=2),  # the data-parallel copies share, the tensor-parallel not
    lambda g: zero(g, 2, 3),  # the shares' sum is reduce-scattered
    lambda g: mesh(g, dp=2, micro=2, fold=True),  # each rank's share sums two micro-batches
], ids=["dp x tp", "zero-3", "dp fold"])
def test_copies_on_shares_of_a_gradient_train_like_one_device(gpt, make):
    w, graph = gpt
    trains_like_one_device(w, ct.compile(make(graph)))


def test_the_loss_rides_in_a_gradient_bucket_not_a_message_of_its_own(gpt):
    """Data parallel's shares of the loss are summed in the last gradient bucket: rank 0
    reports the global loss with no send, receive or collective of its own."""
    w, graph = gpt
    program = ct.compile(data_parallel(graph, 2))
    for code in program.ranks:
        assert not [ins for ins in code if isinstance(ins, (Send, Recv))]
        assert len([ins for ins in code if isinstance(ins, AllReduce)]) == 2  # count, bucket
    code = program.ranks[0]
    loss = next(ins for ins in code if isinstance(ins, Loss))
    bucket = next(ins for ins in code if isinstance(ins, AllReduce) and loss.var in ins.vars)
    assert sum(sums_gradients((k,)) for k in bucket.keys) == len(bucket.keys) - 1
    trains_like_one_device(w, program)


def test_zero_reduce_scatters_start_as_their_gradients_are_made(gpt):
    w, graph = gpt
    program = ct.compile(zero(graph, 2, stage=2), bucket_mb=0.01)
    code = program.ranks[0]
    last_backward = max(i for i, ins in enumerate(code) if isinstance(ins, Backward))
    early = [ins for i, ins in gradient_reductions(code) if i < last_backward]
    assert any(isinstance(ins, ReduceScatter) for ins in early)
    trains_like_one_device(w, program)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_reduce_scatters_go_in_buckets_and_gathers_per_piece_in_one_call(gpt, stage):
    """As FSDP's flat calls: a bucket's reduce-scatters are one call, and the parameters
    one piece reads are gathered in one call."""
    w, graph = gpt
    program = ct.compile(zero(graph, 2, stage=stage))
    code = program.ranks[0]
    scatters = [ins for _, ins in gradient_reductions(code) if isinstance(ins, ReduceScatter)]
    keys = [k for ins in scatters for k in ins.keys]
    assert len(keys) == len(set(keys)) and len(scatters) <= 3 < len(keys)
    gathers = [ins for ins in code if isinstance(ins, AllGather)]
    if stage == 3:
        gathered = [v for ins in gathers for v in ins.vars]
        assert len(gathers) < len(gathered) and max(len(ins.vars) for ins in gathers) >= 2
    trains_like_one_device(w, program)


def test_buckets_in_a_pipeline_with_replicas_train_like_one_device(gpt):
    w, graph = gpt
    trains_like_one_device(w, ct.compile(mesh(graph, dp=2, pp=2, micro=2, schedule="1f1b"),
                                         bucket_mb=0.01))


def test_a_bucket_size_that_is_not_positive_is_refused(gpt):
    with pytest.raises(PlanError, match="bucket_mb"):
        ct.compile(data_parallel(gpt[1], 2), bucket_mb=0)
