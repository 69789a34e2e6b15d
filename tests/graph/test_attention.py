"""Causal attention cut by its queries: each piece is the whole op's rows, values and
gradients alike, and only reads the keys its rows see."""

import pytest
import torch
import torch.nn.functional as F

from chronotope.graph import rng
from chronotope.graph.attention import causal_mask, sliced_attention, visible


def _pieces(fn, q, k, v, cuts, **kw):
    """``fn`` run on the query rows between consecutive ``cuts``, side by side."""
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        region = [(0, n) for n in q.shape[:-2]] + [(lo, hi), (0, v.shape[-1])]
        out.append(fn(q[..., lo:hi, :], k, v, region=region, **kw))
    return torch.cat(out, dim=-2)


@pytest.mark.parametrize("cuts", [(0, 8), (0, 3, 8), (0, 2, 4, 6, 8), (0, 5, 6, 8)])
@pytest.mark.parametrize("gqa", [False, True])
def test_query_pieces_are_the_whole_ops_rows_and_gradients(cuts, gqa):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    kv_heads = 2 if gqa else 4
    k = torch.randn(2, kv_heads, 8, 16, requires_grad=True)
    v = torch.randn(2, kv_heads, 8, 12, requires_grad=True)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=gqa)
    cut = _pieces(sliced_attention, q, k, v, cuts, is_causal=True, scale=0.3, enable_gqa=gqa)
    torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(whole)
    expected = torch.autograd.grad(whole, (q, k, v), g)
    got = torch.autograd.grad(cut, (q, k, v), g)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_piece_reads_no_key_past_its_last_row():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    spoiled = k.clone()
    spoiled[..., 4:, :] = float("nan")  # keys no row of rows 2..3 sees
    region = [(0, 1), (0, 1), (2, 4), (0, 4)]
    out = sliced_attention(q, spoiled, v, is_causal=True, region=region)
    torch.testing.assert_close(out, sliced_attention(q, k, v, is_causal=True, region=region))
    assert torch.isfinite(out).all()


def test_dropout_pieces_draw_and_mask_the_whole_ops_rows():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    stream = rng.Stream(seed=3, step=1)
    whole = rng.attention(q, k, v, None, 0.5, True, key=7, stream=stream)
    cut = _pieces(rng.attention, q, k, v, (0, 3, 8), dropout_p=0.5, is_causal=True, key=7,
                  stream=stream)
    torch.testing.assert_close(cut, whole)


def test_visible_counts_the_pairs_a_causal_mask_keeps():
    for rows, keys in [((0, 4), 4), ((4, 8), 8), ((2, 5), 3), ((0, 1), 10), ((3, 9), 5)]:
        kept = causal_mask(rows, keys, "cpu").sum().item()
        assert visible(rows, keys) == pytest.approx(kept / ((rows[1] - rows[0]) * keys))


def test_a_late_piece_keeps_nothing_as_large_as_its_rows_by_the_keys():
    """Its keys before its rows and beside them are two flash calls merged by their
    log-sum-exps, so no rows x keys mask (or score) is kept for the backward: what a
    piece keeps grows with the sequence, not with its square."""
    q, k, v = torch.randn(1, 2, 64, 8, requires_grad=True), *(
        torch.randn(1, 2, 512, 8, requires_grad=True) for _ in range(2))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t,
                                                  lambda t: t):
        sliced_attention(q, k, v, is_causal=True, region=[(0, 1), (0, 2), (448, 512), (0, 8)])
    assert kept and max(kept) < 64 * 512
