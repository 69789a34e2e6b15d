"""Random ops on the counter-based stream: a piece draws exactly its slice of the whole op's
numbers, so plans with dropout on train like one device."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import chronotope as ct
from chronotope.graph import rng
from chronotope.graph.convert import torch_random
from chronotope.models import get_workload
from chronotope.policies import ParallelConfig, make, tensor_parallel
from chronotope.runtime.local import Optim
from chronotope.runtime.reference import train_reference
from tests.policies.plan_testing import trains_like_one_device


@st.composite
def boxes(draw):
    shape = draw(st.lists(st.integers(1, 6), min_size=0, max_size=4))
    region = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        region.append((lo, draw(st.integers(lo + 1, n))))
    return tuple(shape), tuple(region)


@settings(max_examples=100, deadline=None)
@given(boxes(), st.integers(0, 2**40), st.integers(0, 1000), st.integers(0, 50))
def test_a_piece_draws_its_slice_of_the_whole(box, seed, step, key):
    shape, region = box
    stream = rng.Stream(seed, step)
    whole = rng.uniform(stream, key, shape)
    piece = rng.uniform(stream, key, shape, region)
    assert torch.equal(piece, whole[tuple(slice(lo, hi) for lo, hi in region)])
    assert torch.equal(rng.normal(stream, key, shape, region),
                       rng.normal(stream, key, shape)[tuple(slice(a, b) for a, b in region)])


def test_numbers_are_uniform_and_streams_independent():
    shape = (256, 512)
    u = rng.uniform(rng.Stream(), 0, shape)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert torch.histc(u, 10, 0, 1).div(u.numel()).sub(0.1).abs().max() < 0.005
    for other in (rng.uniform(rng.Stream(step=1), 0, shape), rng.uniform(rng.Stream(), 1, shape),
                  rng.uniform(rng.Stream(seed=1), 0, shape)):
        assert abs(float(torch.corrcoef(torch.stack([u.flatten(), other.flatten()]))[0, 1])) < 0.01
    z = rng.normal(rng.Stream(), 0, shape)
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    kept = rng.dropout(torch.ones(shape), 0.3, key=0)
    assert abs(float((kept > 0).float().mean()) - 0.7) < 0.005
    assert torch.allclose(kept[kept > 0], torch.tensor(1 / 0.7))


def test_eager_code_under_counter_random_draws_what_the_graph_draws():
    """The reference runs the model itself; capture keys each random call by its order."""
    w = get_workload("gpt", dropout=0.2)
    graph = ct.capture(w)
    with rng.CounterRandom(rng.Stream()):
        eager = w.model(*w.inputs)
    assert torch.equal(ct.execute(graph, w), eager)
    plain = w.model(*w.inputs)  # torch's own generator: other numbers
    assert not torch.equal(plain, eager)


POLICIES = {
    "dp": ParallelConfig("dp", 2),
    "tp": ParallelConfig("tp", 2),
    "zero3": ParallelConfig("zero-3", 2),
    "1f1b": ParallelConfig("1f1b", 2, micro=2, fold=False),
    "dp-recompute": ParallelConfig("dp", 2, recompute="full"),
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name, config", [
    ("gpt", {"dropout": 0.1}),
    ("hf-bert", {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}),
])
def test_dropout_trains_like_one_device(name, config, policy):
    w = get_workload(name, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    assert not torch_random(graph)
    trains_like_one_device(w, ct.compile(make(graph, POLICIES[policy])))


def test_exported_dropout_trains_like_one_device():
    w = get_workload("gpt", dropout=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w, frontend="export")
    assert not torch_random(graph)
    trains_like_one_device(w, ct.compile(tensor_parallel(graph, 2)))


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = F.alpha_dropout(self.fc(x), 0.5, True)  # no counter-based form
        return (h + torch.rand_like(h) + x.bernoulli(0.5)).pow(2).mean()


def test_random_ops_left_on_torchs_generator_are_named():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(Noisy(), torch.randn(4, 8))
    assert sorted(op.kind for op in torch_random(graph)) == ["alpha_dropout", "bernoulli"]


def test_calls_that_draw_nothing_stay_as_they_are():
    """Dropout out of training or with p=0, attention without dropout: no key, no rewrite."""
    w = get_workload("gpt", dropout=0.1)
    w.model.eval()
    graph = ct.capture(w)
    assert not any(rng.drawn(op.target) for op in graph.ops) and not torch_random(graph)
    assert any(op.kind == "attention" for op in graph.ops)
    with rng.CounterRandom() as mode:
        w.model(*w.inputs)
    assert mode.calls == 0


class Attention(nn.Module):
    """nn.MultiheadAttention draws its dropout inside one torch function."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0].pow(2).mean()


@pytest.mark.parametrize("model, named", [(Attention, "multi_head_attention_forward"),
                                          (Noisy, "alpha_dropout")])
def test_the_reference_names_calls_that_draw_from_torchs_generator(model, named):
    torch.manual_seed(0)
    w = ct.Workload(model(), (torch.randn(4, 3, 8),))
    assert named in train_reference(w, 2, Optim()).unreplayed
    assert not train_reference(get_workload("gpt", dropout=0.1), 1, Optim()).unreplayed
