"""Signature strings, and the rules that give each built-in op its signature."""

import operator

import pytest
import torch
import torch.nn.functional as F

from chronotope.errors import SignatureError
from chronotope.graph import Signature, default_registry
from chronotope.graph.ir import TensorMeta
from chronotope.graph.registry import OpCall


def test_parse_marks_reduction_frozen_and_fixed_dims():
    sig = Signature.parse("b m k+, b k+ n -> b m n")
    assert sig.names() == ["b", "m", "k", "n"]
    assert sig.dim("k").reduce and not sig.dim("b").reduce
    assert sig.splittable() == ["b", "m", "k", "n"]
    frozen = Signature.parse("b s^ 1 -> b s^")
    assert frozen.splittable() == ["b"]
    assert str(Signature.parse(str(sig))) == str(sig)


def test_group_splits_only_its_leading_factor():
    sig = Signature.parse("b s (h d) -> b s h d")
    assert "h" in sig.splittable() and "d" not in sig.splittable()
    assert sig.bind([(2, 8, 12)], [(2, 8, 3, 4)]) == {"b": 2, "s": 8, "h": 3, "d": 4}


@pytest.mark.parametrize(
    "text, message",
    [
        ("a b+ -> a b+", "reduc"),  # a reduction dim cannot reach the output
        ("a b+, a b -> a", "marked differently"),  # markers agree on every occurrence
        ("a (b -> a", r"\("),
    ],
)
def test_malformed_signatures_are_rejected(text, message):
    with pytest.raises(SignatureError, match=message):
        Signature.parse(text)


def test_bind_reports_the_mismatch():
    sig = Signature.parse("m k+, k+ n -> m n")
    with pytest.raises(SignatureError, match="k"):
        sig.bind([(2, 3), (4, 5)], [(2, 5)])
    with pytest.raises(SignatureError, match="2 inputs"):
        sig.bind([(2, 3)], [(2, 5)])


def signature_of(target, args, kwargs=None, out=None):
    """The signature the default registry gives ``target(*args)``, checked against real shapes."""
    kwargs = kwargs or {}
    result = target(*args, **kwargs) if not isinstance(target, str) else \
        getattr(args[0], target.removeprefix("method:"))(*args[1:], **kwargs)
    outs = [result] if isinstance(result, torch.Tensor) else list(result)
    meta = lambda x: TensorMeta(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x  # noqa: E731
    call = OpCall(tuple(meta(a) if not isinstance(a, list) else [meta(x) for x in a] for a in args),
                  {k: meta(v) for k, v in kwargs.items()}, tuple(meta(o) for o in outs))
    sig = default_registry().lookup(target).signature(call)
    tensors = [t for t in call.tensors]
    sig.bind([t.shape for t in tensors], [o.shape for o in call.outputs])
    return sig


def test_linear_reduces_over_in_features_and_adds_its_bias():
    x, w, b = torch.randn(2, 5, 4), torch.randn(3, 4), torch.randn(3)
    sig = signature_of(F.linear, (x, w, b))
    assert str(sig) == "b0 b1 k+, n k+, n -> b0 b1 n"
    assert default_registry().lookup(F.linear).additive_inputs == (2,)


def test_matmul_broadcasts_batch_dims():
    sig = signature_of(torch.matmul, (torch.randn(2, 1, 5, 4), torch.randn(3, 4, 6)))
    assert str(sig) == "b0 1 m k+, b1 k+ n -> b0 b1 m n"
    assert str(signature_of(operator.matmul, (torch.randn(4), torch.randn(4)))) == "k+, k+ ->"


def test_einsum_reduces_the_letters_the_output_drops():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    assert str(signature_of(torch.einsum, ("bik,bkj->bij", a, b))) == "b i k+, b k+ j -> b i j"
    ell = signature_of(torch.einsum, ("...ik,...kj->...ij", a, b))
    assert str(ell) == "e0 i k+, e0 k+ j -> e0 i j"


def test_reshape_splits_only_dims_it_does_not_merge():
    split = signature_of("method:view", (torch.randn(2, 6, 4), 2, 6, 2, 2))
    assert str(split) == "g0_0 g1_0 (g2_0 g2_1) -> g0_0 g1_0 g2_0 g2_1"
    assert split.splittable() == ["g0_0", "g1_0", "g2_0"]  # 4 -> (2 2): only the leading 2
    merged = signature_of("method:view", (torch.randn(2, 3, 4), 2, 12))
    assert merged.splittable() == ["g0_0", "g1_0"]  # (3 4) -> 12: the 4 is not contiguous
    tangled = signature_of("method:view", (torch.randn(6, 4), 4, 6))
    assert tangled.splittable() == []  # 6x4 -> 4x6 shares no factor boundary


def test_attention_freezes_keys_and_splits_queries_causal_or_not():
    q = torch.randn(2, 4, 8, 16)
    sig = signature_of(F.scaled_dot_product_attention, (q, q, q), {"is_causal": True})
    assert str(sig) == "b0 b1 L E^, b0 b1 S^ E^, b0 b1 S^ Ev -> b0 b1 L Ev"
    free = signature_of(F.scaled_dot_product_attention, (q, q, q))
    assert "L" in free.splittable() and "S" not in free.splittable()
    mask = torch.ones(8, 8, dtype=torch.bool)
    masked = signature_of(F.scaled_dot_product_attention, (q, q, q, mask))
    assert len(masked.inputs) == 4


def test_embedding_never_splits_the_vocabulary():
    sig = signature_of(F.embedding, (torch.randint(0, 10, (2, 3)), torch.randn(10, 4)))
    assert str(sig) == "b0 b1, v^ d -> b0 b1 d"


def test_norms_freeze_the_normalized_dims():
    x = torch.randn(2, 3, 4)
    sig = signature_of(F.layer_norm, (x, (4,), torch.ones(4), torch.zeros(4)))
    assert sig.splittable() == ["d0", "d1"]
    assert signature_of(F.rms_norm, (x, (4,), torch.ones(4))).splittable() == ["d0", "d1"]


def test_cross_entropy_and_mean_are_value_splittable_reductions():
    logits, target = torch.randn(6, 5), torch.randint(0, 5, (6,))
    sig = signature_of(F.cross_entropy, (logits, target))
    assert str(sig) == "n+ c^, n+ ->" and default_registry().lookup(F.cross_entropy).mean_reduction
    assert str(signature_of(torch.sum, (torch.randn(2, 3), 1))) == "d0 d1+ -> d0"


def test_pointwise_ops_broadcast():
    assert str(signature_of(torch.add, (torch.randn(2, 3), torch.randn(3)))) == \
        "d0 d1, d1 -> d0 d1"
    assert str(signature_of(torch.where, (torch.ones(2, 1, dtype=torch.bool),
                                          torch.randn(2, 3), torch.randn(2, 3)))) == \
        "d0 1, d0 d1, d0 d1 -> d0 d1"


def test_factories_have_no_inputs_and_random_ones_never_split():
    assert str(signature_of(torch.zeros, (2, 3))) == "-> d0 d1"
    assert signature_of(torch.randn, (2, 3)).splittable() == []
