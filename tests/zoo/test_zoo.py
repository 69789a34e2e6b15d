"""The zoo trains equal to one device: each family under each policy it runs today,
two SGD steps on two ranks, losses and final weights within 1e-5 (relative).

``python -m tests.zoo`` prints the whole family x policy table, failures included.
"""

from functools import cache

import pytest

import chronotope as ct
from chronotope.graph.ir import Graph
from chronotope.runtime.local import run_in_threads
from chronotope.runtime.reference import compare, train_reference
from tests.zoo.harness import OPTIM, POLICIES, STEPS, TOLERANCE, capture, check
from tests.zoo.models import FAMILIES

SPLIT = ("dp", "tp", "zero-3")
ALL = (*SPLIT, "1f1b", "1f1b-fold")

EQUAL_TODAY: dict[str, tuple[str, ...]] = {
    "opt": ALL,
    "opt-dropout": ALL,
    "gpt-neo": ALL,
    "gpt-j": ALL,
    "mistral": ALL,
    "mistral-frozen": ALL,
    "qwen2": ALL,
    "phi": ALL,
    "gemma": ALL,
    "falcon": ALL,
    "bloom": ALL,
    "mixtral": SPLIT,
    "qwen2-moe": SPLIT,
    "bart": ALL,
    "roberta-cls": ALL,
    "distilbert-cls": ALL,
    "deberta-v2": ALL,
    "deberta-v2-mlm": ALL,
    "electra": ALL,
    "vit": ALL,
    "whisper": ALL,
    "wav2vec2": ALL,
    "clip": SPLIT,
    "cnn-bn": SPLIT,
    "two-tower": SPLIT,
}
CASES = [(family, policy) for family, policies in EQUAL_TODAY.items() for policy in policies]

# Processes as `chronotope run` trains: an encoder-decoder, a frozen table, a batch-coupled loss,
# a pipeline, ops captured by torch.export (batch norm, pooling) and random ops.
GLOO = [("bart", "tp"), ("whisper", "dp"), ("two-tower", "zero-3"), ("opt", "1f1b"),
        ("cnn-bn", "dp"), ("opt-dropout", "tp"), ("mixtral", "dp")]

# What no micro-batch can run alone (batch statistics, a loss coupling the samples, MoE
# dispatch over every token): a pipeline over micro-batches refuses these, naming the op;
# with one micro-batch they pipeline equal to one device.
WHOLE_BATCH = {
    "mixtral": "sort", "qwen2-moe": "sort", "clip": "index",
    "cnn-bn": "batch_norm_div", "two-tower": "matmul",
}


pytestmark = pytest.mark.usefixtures("one_thread")


@cache
def graph_of(family: str) -> Graph:
    """Each family is captured once for all its policies."""
    return capture(FAMILIES[family]())


def test_cases_name_known_families_and_policies():
    assert {f for f, _ in CASES + GLOO} | set(WHOLE_BATCH) <= set(FAMILIES)
    assert {p for _, p in CASES + GLOO} <= set(POLICIES)


@pytest.mark.parametrize("family,policy", CASES)
def test_trains_like_one_device(family: str, policy: str):
    outcome = check(family, policy, graph_of(family))
    assert outcome.status == "ok", outcome


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

