"""Elementwise losses split along any dim: each piece sums (or averages its share of) its
own elements, and the pieces' partial losses add up to one device's."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.policies import data_parallel, tensor_parallel
from tests.policies.plan_testing import trains_like_one_device

LOSSES = {
    "mse": lambda y, t: F.mse_loss(y, t),
    "l1_sum": lambda y, t: F.l1_loss(y, t, reduction="sum"),
    "bce_logits": lambda y, t: F.binary_cross_entropy_with_logits(y, t.sigmoid()),
    "bce_logits_pos_weight": lambda y, t: F.binary_cross_entropy_with_logits(
        y, t.sigmoid(), pos_weight=torch.linspace(0.5, 2, y.shape[-1])),
    "bce_logits_weight_none": lambda y, t: F.binary_cross_entropy_with_logits(
        y, t.sigmoid(), weight=torch.ones(1, y.shape[-1]), reduction="none").mean(),
    "bce": lambda y, t: F.binary_cross_entropy(y.sigmoid(), t.sigmoid()),
}


class Head(nn.Module):
    def __init__(self, loss: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.loss = loss

    def forward(self, x, t):
        return LOSSES[self.loss](self.fc(x), t)


@pytest.mark.parametrize("plan", ["dp", "tp"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_elementwise_losses_split_like_one_device(loss, plan):
    torch.manual_seed(0)
    w = ct.Workload(Head(loss), (torch.randn(4, 8), torch.randn(4, 6)), name=loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    assert not graph.unannotated_ops()
    policy = data_parallel if plan == "dp" else tensor_parallel
    trains_like_one_device(w, ct.compile(policy(graph, 2)))


class Shifted(nn.Module):
    """Decoder inputs made from the labels, as Hugging Face's shift_right does."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, labels):
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1]
        return self.emb(shifted).pow(2).mean()


def test_a_tensor_made_in_the_shape_of_a_batch_keeps_the_batch():
    w = ct.Workload(Shifted(), (torch.randint(0, 16, (4, 6)),), name="shifted")
    graph = ct.capture(w)
    plan = data_parallel(graph, 2)
    assert not plan.unsplit
    trains_like_one_device(w, ct.compile(plan))


class Tagger(nn.Module):
    """A token classifier with a mean cross entropy (or nll) that ignores some labels."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.loss = loss

    def forward(self, x, labels):
        logits = self.fc(x).flatten(0, 1)
        if self.loss == "nll":
            return F.nll_loss(logits.log_softmax(-1), labels.flatten())
        return F.cross_entropy(logits, labels.flatten(), label_smoothing=0.0)


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("loss", ["cross_entropy", "nll"])
def test_a_mean_over_counted_labels_splits_where_pieces_ignore_unequal_counts(loss, frontend):
    """The first half of the batch ignores most of its labels, the second none: a piece's
    mean scaled by its share of the rows is not its share of the loss, so the loss is a sum
    over a count (also in the exported form, whose reduction is an enum)."""
    torch.manual_seed(0)
    labels = torch.randint(0, 5, (4, 6))
    labels[:2, 1:] = -100
    w = ct.Workload(Tagger(loss), (torch.randn(4, 6, 8), labels), name=loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w, frontend=frontend)
    assert {"loss_denominator"} <= {op.kind for op in graph.ops}
    trains_like_one_device(w, ct.compile(data_parallel(graph, 2)))
