"""The policy table: ``make(graph, ParallelConfig(...))`` builds what the policy functions
build, every policy by name, and refuses options the policy does not read."""

import functools
import warnings

import pytest

import chronotope as ct
from chronotope.models import get_workload
from chronotope.policies import POLICIES, ParallelConfig, make, mesh, pipeline, zero
from chronotope.policies.config import FLAGS


@functools.cache
def gpt():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(get_workload("gpt", batch_size=8))


def code(plan) -> list[str]:
    program = ct.compile(plan)
    return [program.code(r) for r in range(plan.ndevices)]


@pytest.mark.parametrize("config,direct", [
    (ParallelConfig("dp", 2), lambda g: mesh(g, dp=2)),
    (ParallelConfig("dp-tp", 4, tp=2, recompute="full"),
     lambda g: mesh(g, 2, 2, recompute="full")),
    (ParallelConfig("zero-3", 2), lambda g: zero(g, 2, 3)),
    (ParallelConfig("1f1b", 4, pp=2, micro=4),
     lambda g: pipeline(g, 2, 4, "1f1b", dp=2, fold=True)),
    (ParallelConfig("1f1b", 4, pp=2, micro=4, fold=False),
     lambda g: pipeline(g, 2, 4, "1f1b", dp=2)),
    (ParallelConfig("interleaved", 2),
     lambda g: pipeline(g, 2, 4, "interleaved", chunks=2, fold=True)),
    (ParallelConfig("chimera", 2), lambda g: pipeline(g, 2, 4, "chimera")),
], ids=lambda x: f"{x.policy}{'-no-fold' if x.fold is False else ''}"
   if isinstance(x, ParallelConfig) else "")
def test_a_config_builds_what_the_policy_function_builds(config, direct):
    assert code(make(gpt(), config)) == code(direct(gpt()))


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"csv", "3f1b"}))  # 3f1b: recycling
def test_every_policy_by_name_makes_a_plan_that_checks(name):
    plan = make(gpt(), ParallelConfig(name, 2 if name == "interlaced" else 4))
    assert plan.check() is not None


def test_pipelines_fold_by_default_and_say_no_fold_to_cut_every_micro_batch():
    """A folded pipeline plans one micro-batch (compile time independent of micro); a
    schedule that runs the model more than once a step (chimera, 3f1b) is cut, and so is
    a mesh without pipeline stages (its micro-batches accumulate gradients)."""
    assert make(gpt(), ParallelConfig("1f1b", 2, micro=4)).micro == 4
    assert make(gpt(), ParallelConfig("1f1b", 2, micro=4, fold=False)).micro == 1
    assert make(gpt(), ParallelConfig("chimera", 2, micro=4)).micro == 1
    assert make(gpt(), ParallelConfig("dp-tp", 4, pp=2, micro=4)).micro == 4
    assert make(gpt(), ParallelConfig("dp-tp", 4, micro=4)).micro == 1  # no pipeline
    with pytest.raises(ct.PlanError, match="does not read --no-fold"):
        make(gpt(), ParallelConfig("dp", 2, fold=False), FLAGS)


def test_options_a_policy_does_not_read_are_refused_in_the_callers_words():
    config = ParallelConfig("tp", 2, tp=4, coshard=7, chunks=5)
    with pytest.raises(ct.PlanError, match=r"policy tp does not read tp=4, chunks=5, "
                                           r"coshard=7 \(it reads recompute, swap\)"):
        make(gpt(), config)
    with pytest.raises(ct.PlanError, match="does not read --tp 4, --chunks 5, --coshard 7"):
        make(gpt(), config, FLAGS)
    with pytest.raises(ct.PlanError, match="unknown policy 'pp'"):
        make(gpt(), ParallelConfig("pp", 2))
    with pytest.raises(ct.PlanError, match="recompute='most': use one of full, selective"):
        make(gpt(), ParallelConfig("dp", 2, recompute="most"))
