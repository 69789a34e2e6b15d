"""3F1B: a model that runs itself again (AlphaFold2 recycling) as a pipeline of its passes."""

import pytest
from plan_testing import captured, trains_like_one_device

import chronotope as ct
from chronotope.policies import actions, pipeline
from chronotope.policies.mesh import recycled_stages


def test_3f1b_trains_the_evoformer_like_one_device():
    w, graph = captured("evoformer", batch_size=4)
    plan = pipeline(graph, 2, 4, "3f1b")
    trains_like_one_device(w, ct.compile(plan), 2)


def test_three_passes_without_gradients_then_one_with():
    _, graph = captured("evoformer", batch_size=4)
    stage, passes = recycled_stages(graph, 2)
    assert passes == 4  # three recycling passes and the last
    # a module's ops are on the same stage rank in every pass
    where = {}
    for op in graph:
        if op.source and op.source.module:
            where.setdefault(op.source.module, set()).add(stage[op] % 2)
    assert all(len(ranks) == 1 for ranks in where.values())
    plan = pipeline(graph, 2, 4, "3f1b")
    for rank, steps in actions(plan).items():
        forwards = [a for a in steps if "F" in a]
        backwards = [a for a in steps if "B" in a]
        assert len(forwards) == 4 * 4 and len(backwards) == 4  # 4 passes, 4 micro-batches
        assert {int(a.split("B")[0]) for a in backwards} == {6 + rank}  # the last pass only
    recycled = [op for op in plan.forward_leaves() if stage[op.op] < 6]
    assert recycled and all(plan.backward_op(op) is None for op in recycled)


def test_3f1b_needs_a_recycling_model():
    _, graph = captured("gpt", batch_size=4)
    with pytest.raises(ct.PlanError, match="runs itself several times"):
        pipeline(graph, 2, 2, "3f1b")
