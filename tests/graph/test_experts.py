"""Routed experts as one op: Hugging Face's MoE experts captured as it (Switch Transformers'
with the tokens its capacity drops), its pieces of tokens and of experts the whole op's
parts, and a model's own router calling it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.graph import experts as experts_module
from chronotope.graph.experts import hugging_face_experts, routed_experts, supported
from chronotope.policies import data_parallel, expert_parallel
from tests.policies.plan_testing import trains_like_one_device
from tests.zoo.harness import capture
from tests.zoo.models import FAMILIES

MOE = ("mixtral", "qwen2-moe", "deepseek-v3", "olmoe")


def _case(tokens=10, d=8, experts=4, f=6, k=2, dtype=torch.float64):
    torch.manual_seed(0)
    x = torch.randn(tokens, d, dtype=dtype, requires_grad=True)
    index = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, dtype=dtype, requires_grad=True)
    gate, up = (torch.randn(experts, f, d, dtype=dtype, requires_grad=True) for _ in range(2))
    down = torch.randn(experts, d, f, dtype=dtype, requires_grad=True)
    return x, index, weights, gate, up, down


def test_its_gradients_are_the_ops_own():
    x, index, weights, gate, up, down = _case()
    assert torch.autograd.gradcheck(
        lambda *a: routed_experts(a[0], index, a[1], a[2], a[3], a[4], 0, "silu"),
        (x, weights, gate, up, down))


def test_pieces_of_experts_and_of_tokens_are_parts_of_the_whole():
    x, index, weights, gate, up, down = _case()
    whole = routed_experts(x, index, weights, gate, up, down, 0, "gelu")
    by_experts = sum(routed_experts(x, index, weights, gate[e:e + 2], up[e:e + 2],
                                    down[e:e + 2], e, "gelu") for e in (0, 2))
    torch.testing.assert_close(by_experts, whole)
    first = routed_experts(x[:4], index[:4], weights[:4], gate, up, down, 0, "gelu")
    torch.testing.assert_close(first, whole[:4])


@pytest.mark.parametrize("family", MOE)
def test_hugging_face_experts_are_one_op_each_and_split_along_the_tokens(family):
    w = FAMILIES[family]()
    graph = capture(w)  # (capture checks the graph against the model)
    experts = [op for op in graph.ops if op.kind == "experts"]
    assert experts and not any(op.kind in ("sort", "grouped_mm") for op in graph.ops)
    modules = [m for m in w.model.modules() if hasattr(m, "_is_expert_parallel")]
    assert len(modules) == len(experts) and all(supported(m) is None for m in modules)
    assert w.model.config._experts_implementation != "chronotope"  # left as it was
    plan = data_parallel(graph, 2)
    assert not plan.unsplit  # each device routes its own tokens
    trains_like_one_device(FAMILIES[family](), ct.compile(plan))


def test_switch_transformers_experts_are_one_op_that_drops_what_capacity_has_no_room_for(
        monkeypatch):
    """One module per expert, their weights stacked; a token over its expert's capacity
    (3 per sequence of 16 here) is routed to no expert (-1) and gets nothing, as in the
    model: capture checks the graph's loss and gradients against the model's own loop."""
    w = FAMILIES["switch"]()
    graph = capture(w)
    experts = [op for op in graph.ops if op.kind == "experts"]
    assert len(experts) == 2 and graph.unannotated_ops() == []  # encoder's and decoder's
    seen, forward = [], experts_module._forward
    monkeypatch.setattr(experts_module, "_forward", lambda x, index, *a: (
        seen.append(index), forward(x, index, *a))[1])
    with hugging_face_experts(w.model):
        w.model(**w.kwargs)
    index = seen[0].reshape(4, -1)  # (the encoder's: 4 sequences of 16 tokens, top-1)
    assert (index == -1).any()
    per_sequence = torch.stack([(index == e).sum(1) for e in range(4)])
    assert per_sequence.max() <= 3


def test_switch_transformers_experts_it_cannot_run_are_refused_by_name():
    w = FAMILIES["switch"]()
    for m in w.model.modules():
        if type(m).__name__ == "SwitchTransformersDenseActDense":
            m.dropout.p = 0.1
    with pytest.raises(ct.CaptureError, match="dropout between the experts' layers"):
        ct.capture(w)


def test_hugging_face_experts_it_cannot_run_as_one_op_are_named_and_run_as_written():
    """GPT-OSS's experts have biases: capture warns, naming them and why, they train as
    written, and expert parallelism is refused."""
    import transformers as tf

    from tests.zoo.models import DECODER, _causal_lm

    config = tf.GptOssConfig(**{**DECODER, "attn_implementation": "eager"},
                             num_local_experts=4, num_experts_per_tok=2)
    w = _causal_lm("gpt-oss", tf.GptOssForCausalLM, config, 0, None)
    with pytest.warns(UserWarning, match="GptOssExperts: run as written.*biases"):
        graph = ct.capture(w)
    assert not any(op.kind == "experts" for op in graph.ops)
    with pytest.raises(ct.PlanError, match="none captured as routed experts"):
        expert_parallel(graph, 2)


class TopOne(nn.Module):
    """A model's own top-1 router calling routed_experts, ungated experts."""

    def __init__(self, d=8, experts=4, f=16) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, d)
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, f, d) / d ** 0.5)
        self.w_out = nn.Parameter(torch.randn(experts, d, f) / f ** 0.5)
        self.head = nn.Linear(d, 32)

    def forward(self, ids, labels):
        x = self.embed(ids).flatten(0, 1)
        weight, index = self.router(x).softmax(-1).topk(1, dim=-1)
        y = routed_experts(x, index, weight, self.w_in, None, self.w_out, 0, "relu")
        return F.cross_entropy(self.head(x + y), labels.flatten())


def test_a_models_own_router_calls_it_and_shares_its_experts_out():
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 6))
    w = ct.Workload(TopOne(), (ids, ids.roll(1, 1)), name="top-one")
    graph = ct.capture(w)
    (op,) = [op for op in graph.ops if op.kind == "experts"]
    assert str(op.signature) == "t d^, t k^, t k^, e+ f+ d^, e+ d^ f+ -> t d^"
    trains_like_one_device(w, ct.compile(expert_parallel(graph, 2)))
