"""3F1B: a model that runs itself again (AlphaFold2 recycling) as a pipeline of its passes."""

import warnings

import pytest

import chronotope as ct
from chronotope.models import get_workload
from chronotope.policies import actions, pipeline
from chronotope.policies.mesh import recycled_stages
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference


def captured(name: str, **kw):
    w = get_workload(name, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


def test_3f1b_trains_the_evoformer_like_one_device():
    w, graph = captured("evoformer", batch_size=4)
    plan = pipeline(graph, 2, 4, "3f1b")
    run = run_in_threads(ct.compile(plan), w, 2, Optim("sgd", 0.1))
    diff = compare(run, train_reference(w, 2, Optim("sgd", 0.1)))
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff


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
