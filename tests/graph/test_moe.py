"""Mixture-of-Experts layers: the grouped matmul of the experts splits where its form allows
(features always, experts without offsets), Hugging Face MoE models capture with every op
signed (their experts as one op, ``tests/graph/test_experts.py``), and an expert-parallel
plan of a capacity-based MoE trains like one device."""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.graph.axes import follow
from chronotope.policies import mesh
from tests.graph.op_testing import Case, per_op_tests, trains_like_one_device
from tests.zoo.models import FAMILIES


class Experts(nn.Module):
    """E experts' weights, and the rows each expert takes (ends of runs of rows)."""

    def __init__(self, experts: int, k: int, n: int, ends: list[int],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter((torch.randn(experts, k, n) / k ** 0.5).to(dtype))
        self.register_buffer("offs", torch.tensor(ends, dtype=torch.int32), persistent=False)


def _grouped(m: Experts, h: torch.Tensor) -> torch.Tensor:
    """torch's grouped matmul, which takes bfloat16 (on meta tensors too)."""
    offs = m.offs if h.dim() == 2 else None
    return F.grouped_mm(h.to(torch.bfloat16), m.weight, offs=offs)


def _fallback(m: Experts, h: torch.Tensor) -> torch.Tensor:
    import transformers.integrations.moe  # noqa: F401  (registers the op)

    return torch.ops.transformers.grouped_mm_fallback(h, m.weight, m.offs)


BF16 = torch.bfloat16
CASES = {
    "grouped_mm-offsets": Case((8, 16), _grouped, "grouped_mm", ("k", "n"), tolerance=2e-2,
                               inner=lambda: Experts(2, 16, 16, [3, 8], BF16)),
    "grouped_mm-experts": Case((2, 4, 16), _grouped, "grouped_mm", ("e", "m", "k", "n"),
                               tolerance=2e-2, inner=lambda: Experts(2, 16, 16, [], BF16)),
    "transformers-grouped_mm": Case((6, 4), _fallback, "grouped_mm", ("k", "n"),
                                    inner=lambda: Experts(3, 4, 6, [1, 4, 6])),
    "cat-empty-cache": Case((4, 2, 6), lambda m, h: torch.cat([h.new_zeros(0), h, h], dim=2),
                            "cat", ("d0", "d1")),
}


test_signature_names_the_dims_that_split, test_split_along_each_dim_trains_like_one_device = \
    per_op_tests(CASES)


class CapacityMoE(nn.Module):
    """A Switch-style top-1 MoE with expert capacity: tokens dispatched to (expert, slot) by
    one-hot masks and einsums, the experts a batched matmul over their dim."""

    def __init__(self, d: int = 8, f: int = 16, experts: int = 4, capacity: int = 6) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.w1 = nn.Parameter(torch.randn(experts, d, f) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, f, d) / f ** 0.5)
        self.head = nn.Linear(d, 3)
        self.experts, self.capacity = experts, capacity

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(tokens), dim=-1)
        gate, choice = probs.max(dim=-1)
        mask = F.one_hot(choice, self.experts).float()
        slot = (torch.cumsum(mask, dim=0) - 1) * mask
        kept = mask * (slot < self.capacity).float()
        slots = F.one_hot(slot.long().clamp(max=self.capacity - 1), self.capacity)
        dispatch = kept.unsqueeze(-1) * slots.float()
        expert_in = torch.einsum("sec,sd->ecd", dispatch, tokens)
        out = torch.bmm(torch.relu(torch.bmm(expert_in, self.w1)), self.w2)
        mixed = torch.einsum("sec,ecd->sd", dispatch * gate[:, None, None], out)
        logits = self.head(tokens + mixed)
        return F.cross_entropy(logits, y.reshape(-1))


def capacity_moe() -> tuple[ct.Workload, ct.Graph]:
    torch.manual_seed(0)
    w = ct.Workload(CapacityMoE(), (torch.randn(2, 8, 8), torch.randint(0, 3, (2, 8))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


def test_expert_parallel_capacity_moe_trains_like_one_device():
    """Every op that has the expert dim is split along it (the dispatch masks, the expert
    inputs, both expert matmuls and the combine, a sum over experts)."""
    w, graph = capacity_moe()
    assert graph.unannotated_ops() == []
    one_hot = next(op for op in graph if op.kind == "one_hot")
    expert = follow(graph, {one_hot.outputs[0]: 1})
    bmm = [op for op in graph if op.kind == "matmul" and len(op.inputs[1].shape) == 3]
    assert len(bmm) == 2 and all(expert[op] == "b0" for op in bmm)
    assert any(op.kind == "einsum" and expert[op] and op.signature.dim(expert[op]).reduce
               for op in graph)  # the combine sums over the experts
    plan = ct.Plan(graph, 2)
    for op in graph:
        algo = ct.Split(expert[op], 2) if expert[op] else ct.Replicate(2)
        for device, piece in enumerate(plan.trans(op, algo)):
            plan.assign(piece, device)
    trains_like_one_device(plan, w)


def test_data_parallel_capacity_moe_trains_like_one_device():
    w, graph = capacity_moe()
    trains_like_one_device(mesh(graph, dp=2), w)


@functools.cache
def hf_moe(family: str) -> tuple[ct.Workload, ct.Graph]:
    w = FAMILIES[family]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_hugging_face_moe_captures_every_op_with_a_signature(family):
    _, graph = hf_moe(family)
    assert graph.unannotated_ops() == []
    assert {"topk", "experts"} <= {op.kind for op in graph}  # routing, then one op


@pytest.mark.parametrize("policy", ["dp", "tp"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_hugging_face_moe_trains_like_one_device(family, policy):
    w, graph = hf_moe(family)
    trains_like_one_device(mesh(graph, dp=2) if policy == "dp" else mesh(graph, tp=2), w)
