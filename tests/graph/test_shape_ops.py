"""Indexing and transposes user code writes (Falcon's ``fused_qkv[..., [-2], :]``, a
weight's ``.T``): each split along every dim its signature lets split trains like one
device."""

from tests.graph.op_testing import Case, per_op_tests

CASES = {
    "list-index": Case((4, 3, 6), lambda m, h: h[..., [1, -1], :], "getitem", ("d0", "d2"),
                       frontends=("fx",)),
    "T": Case((4, 6), lambda m, h: h.T, "transpose", ("d0", "d1"), frontends=("fx",)),
    "mT": Case((4, 2, 6), lambda m, h: h.mT, "transpose", ("d0", "d1", "d2"),
               frontends=("fx",)),
}


test_signature_names_the_dims_that_split, test_split_along_each_dim_trains_like_one_device = \
    per_op_tests(CASES)
