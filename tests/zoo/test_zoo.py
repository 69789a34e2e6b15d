"""The zoo trains equal to one device: each family under each policy it runs today,
two SGD steps on two ranks, losses and final weights within 1e-5 (relative).

``python -m tests.zoo`` prints the whole family x policy table, failures included.
"""

from functools import cache

import pytest
import torch

from chronotope.graph.ir import Graph
from tests.zoo.harness import POLICIES, capture, check
from tests.zoo.models import FAMILIES

SPLIT = ("dp", "tp", "zero-3")
ALL = (*SPLIT, "1f1b")

EQUAL_TODAY: dict[str, tuple[str, ...]] = {
    "opt": ALL,
    "opt-dropout": ALL,
    "gpt-neo": ALL,
    "gpt-j": ALL,
    "mistral": ALL,
    "mistral-frozen": SPLIT,
    "qwen2": ALL,
    "phi": ALL,
    "gemma": ALL,
    "falcon": SPLIT,
    "bloom": ALL,
    "mixtral": SPLIT,
    "qwen2-moe": SPLIT,
    "bart": SPLIT,
    "roberta-cls": SPLIT,
    "distilbert-cls": SPLIT,
    "deberta-v2": ALL,
    "deberta-v2-mlm": ALL,
    "electra": SPLIT,
    "vit": ALL,
    "whisper": SPLIT,
    "wav2vec2": ALL,
    "clip": SPLIT,
    "cnn-bn": SPLIT,
    "two-tower": SPLIT,
}
CASES = [(family, policy) for family, policies in EQUAL_TODAY.items() for policy in policies]

# Processes as `chronotope run` trains: an encoder-decoder, a frozen table, a batch-coupled loss,
# a pipeline, ops captured by torch.export (batch norm, pooling) and random ops.
GLOO = [("bart", "tp"), ("whisper", "dp"), ("two-tower", "zero-3"), ("opt", "1f1b"),
        ("cnn-bn", "dp"), ("opt-dropout", "tp")]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run hundreds of small ops: extra threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@cache
def graph_of(family: str) -> Graph:
    """Each family is captured once for all its policies."""
    return capture(FAMILIES[family]())


def test_cases_name_known_families_and_policies():
    assert {f for f, _ in CASES + GLOO} <= set(FAMILIES)
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
