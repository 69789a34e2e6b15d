"""Backward regions: pieces with no communication between them share one autograd call."""

import warnings

import pytest

import chronotope as ct
from chronotope.compile.program import AllReduce, Assemble, Backward, Forward, covers, reads
from chronotope.models import get_workload
from tests.policies.plan_testing import trains_like_one_device


def _graph(name: str) -> ct.Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(get_workload(name))


def test_data_parallel_backward_is_one_call():
    program = ct.compile(ct.policies.data_parallel(_graph("gpt"), 2))
    code = program.ranks[0]
    regions = [i for i in code if isinstance(i, Backward)]
    pieces = sum(len(r.ops) for r in regions)
    plan = program.plan
    mine = {b for f in plan.forward_leaves() if f.device == 0
            and (b := plan.backward_op(f)) is not None}
    assert pieces == len(mine) and {op for r in regions for op in r.ops} == mine
    # Nothing communicates inside the backward: each rank's loss piece divides its own sum
    # by the all-reduced count, and the position embedding's copy runs its backward on its
    # rank's share of its output's gradient.
    assert len(regions) == 1
    linked = sum(sum(f.linked) for f in code if isinstance(f, Forward) and f.linked)
    assert linked > pieces  # most edges carry their gradient inside autograd


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_tensor_parallel_regions_end_only_at_communication(name):
    program = ct.compile(ct.policies.tensor_parallel(_graph(name), 2))
    code = program.ranks[0]
    start = next(i for i, x in enumerate(code) if isinstance(x, Backward))
    regions = sum(isinstance(x, Backward) for x in code[start:])
    reduces = sum(isinstance(x, AllReduce) for x in code[start:])
    # A region ends where an all-reduce needs its gradient, or where a gradient
    # arrives for an output that went through one in forward (the row-parallel sums).
    assert regions <= 2 * reduces + 1
    assert regions < len({op for x in code if isinstance(x, Backward) for op in x.ops}) / 4


def test_micro_batches_weight_gradients_are_summed_as_made_into_one_total():
    """Each micro-batch's weight gradient is added, as its backward makes it, into one
    running total made on the rank and read nowhere else, in place: one add per part."""
    w = get_workload("gpt", n_layer=2, d_model=32, n_head=2, block_size=16, batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    program = ct.compile(ct.policies.pipeline(graph, 2, 4, "1f1b"))
    code = program.ranks[0]
    running = [ins for ins in code if isinstance(ins, Assemble) and ins.accumulate]
    assert running
    made_here = {ins.var for ins in code if isinstance(ins, Assemble)}
    read = [v for ins in code for v in reads(ins)]
    for ins in running:
        total, part = ins.parts
        assert total.src in made_here and read.count(total.src) == 1
        assert covers(part.dst_slices, ins.shape) and part.scale == 1
    trains_like_one_device(w, program)
