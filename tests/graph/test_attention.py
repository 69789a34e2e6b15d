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


class _Landing:
    """Keys and values whose runs land one at a time: NaN until waited for, so a piece
    that reads a run before its wait gives NaN."""

    def __init__(self, key, value, runs, leaving=None):
        self.whole = (key.detach().clone(), value.detach().clone())
        self.key, self.value = (torch.full_like(t, float("nan")).requires_grad_()
                                for t in (key, value))
        self._runs, self.waited = runs, []
        self.leaving, self.read_by, self.left = leaving, {}, {}

    def runs(self):
        return self._runs

    def read(self, piece, runs):
        self.read_by[piece] = tuple(runs)

    def leave(self, piece, run, grads):  # device 0's own runs: chunks 0 and 3
        if self.leaving == "all" or (self.leaving == "others" and run not in (0, 1)):
            self.left[run] = grads
            return True
        return False

    def wait(self, run):
        lo, hi = self._runs[run]
        with torch.no_grad():
            for got, whole in zip((self.key, self.value), self.whole):
                got[..., lo:hi, :] = whole[..., lo:hi, :]
        self.waited.append(run)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("ev", [16, 12])  # 12: the block kernel in plain matmuls
@pytest.mark.parametrize("leaving", [None, "others", "all"])
def test_ring_pieces_attend_to_each_run_as_it_lands_and_equal_the_whole_op(causal, gqa, ev,
                                                                           leaving):
    """A zigzag of 4 chunks over 2 devices: device 0 holds chunks 0 and 3, its runs of
    keys and values come own first, then device 1's (chunks 1 and 2). With ``leaving``
    the gradients of device 1's runs (``others``), or of every run (``all``: the ring keeps
    device 0's), are given to the ring a block each, not returned."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 16, requires_grad=True)
    heads = 2 if gqa else 4
    k = torch.randn(2, heads, 16, 16, requires_grad=True)
    v = torch.randn(2, heads, 16, ev, requires_grad=True)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3,
                                           enable_gqa=gqa)
    g = torch.randn_like(whole)
    for rows in [(0, 4), (12, 16)]:  # device 0's query chunks
        landing = _Landing(k, v, [(0, 4), (12, 16), (4, 8), (8, 12)], leaving)
        region = [(0, 2), (0, 4), rows, (0, ev)]
        out = sliced_attention(q[..., rows[0]:rows[1], :], landing.key, landing.value,
                               is_causal=causal, scale=0.3, enable_gqa=gqa, region=region,
                               arriving=landing)
        torch.testing.assert_close(out, whole[..., rows[0]:rows[1], :], rtol=1e-5, atol=1e-5)
        seen = [0] if causal and rows == (0, 4) else [0, 1, 2, 3]
        assert landing.waited == seen  # in the order they land, only those its rows see
        dq, dk, dv = torch.autograd.grad(out, (q, landing.key, landing.value),
                                         g[..., rows[0]:rows[1], :])
        assert set(landing.read_by[tuple(map(tuple, region))]) == set(seen)
        left = {"others": {2, 3}, "all": {0, 1, 2, 3}}.get(leaving, set())
        assert set(landing.left) == left & set(seen)
        dk, dv = dk.clone(), dv.clone()
        for run, (gk, gv) in landing.left.items():  # what left is not given back as well
            lo, hi = landing.runs()[run]
            assert not dk[..., lo:hi, :].any() and not dv[..., lo:hi, :].any()
            dk[..., lo:hi, :], dv[..., lo:hi, :] = gk, gv
        rows_only = torch.zeros_like(g)
        rows_only[..., rows[0]:rows[1], :] = g[..., rows[0]:rows[1], :]
        for a, b in zip((dq, dk, dv), torch.autograd.grad(whole, (q, k, v), rows_only,
                                                           retain_graph=True)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
