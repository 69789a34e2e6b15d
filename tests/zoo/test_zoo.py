"""The zoo trains equal to one device: each family under each policy it runs today,
two SGD steps on two ranks, losses and final weights within 1e-5 (relative).

``python -m tests.zoo`` prints the whole family x policy table, failures included.
"""

import warnings
from functools import cache

import pytest

import chronotope as ct
from chronotope.graph.ir import Graph
from chronotope.policies import mesh
from chronotope.policies.pipeline import MULTI_STAGE
from chronotope.runtime.local import run_in_threads
from chronotope.runtime.reference import compare, train_reference
from tests.zoo.harness import OPTIM, POLICIES, STEPS, TOLERANCE, capture, check
from tests.zoo.models import FAMILIES

SPLIT = ("dp", "tp", "zero-3")
ALL = (*SPLIT, "1f1b", "1f1b-fold")
NO_TP = tuple(p for p in ALL if p != "tp")
CP = ("cp", "cp-4", "ring-4", "ulysses-4")  # context parallel: the families that call sdpa
# on tokens
EP = ("ep", "ep-4")  # expert parallel: the Mixture-of-Experts families

EQUAL_TODAY: dict[str, tuple[str, ...]] = {
    "opt": (*ALL, *CP),
    "opt-dropout": (*ALL, *CP),
    "gpt-neo": ALL,
    "gpt-j": (*ALL, *CP),
    "mistral": (*ALL, *CP),
    "mistral-frozen": (*ALL, *CP),
    "qwen2": (*ALL, *CP),
    "phi": (*ALL, *CP),
    "gemma": (*ALL, *CP),
    "falcon": (*ALL, *CP),
    "bloom": ALL,
    "mixtral": (*SPLIT, *CP, *EP),
    "qwen2-moe": (*ALL, *CP, *EP),
    "bart": (*ALL, *CP),
    "roberta-cls": (*ALL, *CP),
    "distilbert-cls": (*ALL, *CP),
    "deberta-v2": ALL,
    "deberta-v2-mlm": ALL,
    "electra": (*ALL, *CP),
    "vit": ALL,
    "whisper": ALL,
    "wav2vec2": ALL,
    "clip": SPLIT,
    "cnn-bn": ("dp", "zero-3"),
    "two-tower": SPLIT,
    "t5-v1.1": (*ALL, *CP),
    "albert": (*ALL, *CP),
    "gemma3": (*ALL, *CP),
    "deepseek-v2": (*ALL, *CP, *EP),
    "deepseek-v3": (*ALL, *CP, *EP),
    "gpt-bigcode": (*ALL, *CP),
    "granite": (*ALL, *CP),
    "olmoe": (*SPLIT, *CP, *EP),
    "switch": (*ALL, *EP),
    "mamba": ALL,
    "bigbird": ALL,
    "convnext": ALL,
    "swin": ALL,
    "siglip": ALL,
    "unet": NO_TP,
    "lstm-lm": ALL,
    "gru-lm": NO_TP,
    "embedding-bag": SPLIT,
    "drop-path": ALL,
    "checkpointed": ALL,
    "checkpointed-reentrant": ALL,
    "gnn": SPLIT,
    "sdpa-gqa": (*ALL, "cp", "cp-4", "ring-4"),  # ulysses: 2 key heads do not cut 4 ways
    "custom-function": ALL,
    "no-grad": SPLIT,
    "inplace-slices": ALL,
    "unused-param": ALL,
    "counter-buffer": ALL,
    "last-token": (*ALL, *CP),
    "uncertainty-loss": ALL,
}
CASES = [(family, policy) for family, policies in EQUAL_TODAY.items() for policy in policies]

# Processes as `chronotope run` trains: an encoder-decoder, a frozen table, a batch-coupled loss,
# a pipeline, ops captured by torch.export (batch norm, pooling) and random ops.
GLOO = [("bart", "tp"), ("whisper", "dp"), ("two-tower", "zero-3"), ("opt", "1f1b"),
        ("cnn-bn", "dp"), ("opt-dropout", "tp"), ("mixtral", "dp"),
        # the idioms: a Function's own backward, writes into slices, random draws in place
        ("custom-function", "1f1b"), ("inplace-slices", "tp"), ("drop-path", "1f1b-fold"),
        # context parallel: keys gathered for a zigzag of causal chunks (whole, round a
        # ring), heads all-to-all
        ("qwen2", "cp-4"), ("gemma", "ring-4"), ("mixtral", "ulysses-4"),
        # expert parallel: each rank's tokens through every rank's experts, and back; those
        # an expert's capacity drops nowhere
        ("qwen2-moe", "ep-4"), ("switch", "ep-4")]

# What no micro-batch can run alone (batch statistics, a loss coupling the samples, a
# router's balancing loss over every token, bags of an EmbeddingBag, a graph's adjacency
# over all its nodes, a statistic over the batch): a pipeline over micro-batches refuses
# these, naming the op; with one micro-batch they pipeline equal to one device.
WHOLE_BATCH = {
    "mixtral": "div", "clip": "index",
    "cnn-bn": "batch_norm_div", "two-tower": "matmul",
    "olmoe": "div", "embedding-bag": "embedding_bag",
    "gnn": "matmul", "no-grad": "mean",
}


pytestmark = pytest.mark.usefixtures("one_thread")


@cache
def graph_of(family: str) -> Graph:
    """Each family is captured once for all its policies."""
    return capture(FAMILIES[family]())


def test_cases_name_known_families_and_policies():
    assert {f for f, _ in CASES + GLOO} | set(WHOLE_BATCH) <= set(FAMILIES)
    assert {p for _, p in CASES + GLOO} <= set(POLICIES)


# Nothing tensor parallelism cuts (convolutions, a recurrent cell, projections too narrow
# for 2): tp would only replicate, and is refused, naming why.
NOTHING_TO_CUT = ("cnn-bn", "unet", "gru-lm")


@pytest.mark.parametrize("family,policy", CASES)
def test_trains_like_one_device(family: str, policy: str):
    outcome = check(family, policy, graph_of(family))
    assert outcome.status == "ok", outcome


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_coshard_checks_or_is_refused_by_name(family: str):
    """Each attention and MLP in two parts per device of two: parts that would wait on
    one another (a piece reading a later part, a run fed back from outside) are not run
    one after another, so the plan checks free of deadlocks, or nothing splits."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = mesh(graph_of(family), tp=2, coshard=2)
    except ct.PlanError as e:
        assert "splits 4 ways (tp 2 x coshard 2)" in str(e) or "splits nothing" in str(e), e
        return
    plan.check()


@pytest.mark.parametrize("family", NOTHING_TO_CUT)
def test_tensor_parallelism_that_cuts_nothing_is_refused(family: str):
    outcome = check(family, "tp", graph_of(family))
    assert outcome.status == "refused" and outcome.stage == "plan", outcome
    assert "splits nothing" in outcome.error, outcome


@pytest.mark.slow
@pytest.mark.parametrize("family,policy", GLOO)
def test_trains_like_one_device_in_processes(family: str, policy: str):
    outcome = check(family, policy, graph_of(family), transport="gloo")
    assert outcome.status == "ok", outcome


@pytest.mark.parametrize("family", list(WHOLE_BATCH))
def test_pipelines_refuse_what_needs_the_whole_batch_and_run_it_in_one_micro_batch(family):
    graph = graph_of(family)
    for fold in (False, True):
        with pytest.raises(ct.PlanError, match=f"cannot run op {WHOLE_BATCH[family]}") as error:
            ct.policies.pipeline(graph, 2, 2, "1f1b", fold=fold)
        assert not isinstance(error.value, ct.DeadlockError)
    program = ct.compile(ct.policies.pipeline(graph, 2, 1, "1f1b"))
    run = run_in_threads(program, FAMILIES[family](), STEPS, OPTIM)
    assert compare(run, train_reference(FAMILIES[family](), STEPS, OPTIM)).within(TOLERANCE)



SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1", "zbv", "chimera")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_pipeline_schedule_compiles_or_is_refused_by_name(family):
    """No built-in schedule makes a plan that deadlocks: each compiles (its replay runs
    through) or is refused with a PlanError naming why, never a DeadlockError."""
    graph = graph_of(family)
    for schedule in SCHEDULES:
        try:
            plan = ct.policies.pipeline(graph, 2, 4, schedule,
                                        chunks=2 if schedule in MULTI_STAGE else 1)
            ct.compile(plan)
        except ct.DeadlockError:
            raise
        except ct.PlanError as e:
            assert "cannot run op" in str(e) or "stages need" in str(e) or \
                "divisible" in str(e), (schedule, str(e))
