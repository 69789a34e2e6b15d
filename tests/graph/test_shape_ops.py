"""Indexing and transposes user code writes (Falcon's ``fused_qkv[..., [-2], :]``, a
weight's ``.T``): each split along every dim its signature lets split trains like one
device."""

import pytest

from tests.graph.op_testing import Case, split_one, the_op, trains_like_one_device

CASES = {
    "list-index": Case((4, 3, 6), lambda m, h: h[..., [1, -1], :], "getitem", ("d0", "d2"),
                       frontends=("fx",)),
    "T": Case((4, 6), lambda m, h: h.T, "transpose", ("d0", "d1"), frontends=("fx",)),
    "mT": Case((4, 2, 6), lambda m, h: h.mT, "transpose", ("d0", "d1", "d2"),
               frontends=("fx",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_signature_names_the_dims_that_split(name):
    _, graph = CASES[name].captured("fx")
    op = the_op(graph, CASES[name].kind)
    assert sorted(op.signature.splittable()) == sorted(CASES[name].dims), str(op.signature)


@pytest.mark.parametrize("name, dim", [(n, d) for n, c in CASES.items() for d in c.dims])
def test_split_along_each_dim_trains_like_one_device(name, dim):
    w, graph = CASES[name].captured("fx")
    trains_like_one_device(split_one(graph, the_op(graph, CASES[name].kind), dim), w)
