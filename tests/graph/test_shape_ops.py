"""Indexing, transposes and reductions user code writes (Falcon's ``fused_qkv[..., [-2], :]``,
a weight's ``.T``, Switch Transformers' ``torch.max(mask, axis=-2)``, NumPy's name for
``dim``, a ``repeat_interleave`` told its output's size), and rotary embeddings written as
complex products (Llama 4's, DeepSeek-V2's): each split along every dim its signature lets
split trains like one device."""

import torch

from tests.graph.op_testing import Case, per_op_tests

CASES = {
    "list-index": Case((4, 3, 6), lambda m, h: h[..., [1, -1], :], "getitem", ("d0", "d2"),
                       frontends=("fx",)),
    "T": Case((4, 6), lambda m, h: h.T, "transpose", ("d0", "d1"), frontends=("fx",)),
    "mT": Case((4, 2, 6), lambda m, h: h.mT, "transpose", ("d0", "d1", "d2"),
               frontends=("fx",)),
    "max-axis": Case((4, 3, 6), lambda m, h: torch.max(h, axis=-2).values, "max", ("d0", "d2"),
                     frontends=("fx",)),
    "complex-rotary": Case((2, 4, 2, 8), lambda m, h: _rotated(h), "view_as_complex",
                           ("d0", "d1", "d2", "d3"), frontends=("fx",)),
    "repeat_interleave-output_size": Case(  # (NemotronH's: a size the piece's must replace)
        (4, 2, 6), lambda m, h: h.repeat_interleave(2, dim=1, output_size=4), "repeat",
        ("d0", "d1", "d2"), frontends=("fx",)),
    "mean-axis": Case((4, 2, 6), lambda m, h: torch.mean(h, axis=1), "mean", ("d0", "d1", "d2"),
                      frontends=("fx",)),
}



def _rotated(h: torch.Tensor) -> torch.Tensor:
    """``h`` (batch, sequence, heads, head dim) turned by each position's angles: pairs of
    features as complex numbers times ``polar(1, angle)``, back to reals."""
    angles = torch.outer(torch.arange(h.shape[1], dtype=torch.float32), torch.arange(1., 5.))
    turn = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    pairs = torch.view_as_complex(h.float().reshape(*h.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * turn).flatten(3)


test_signature_names_the_dims_that_split, test_split_along_each_dim_trains_like_one_device = \
    per_op_tests(CASES)
