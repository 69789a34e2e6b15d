"""RVD layouts: to and from pieces, and to and from DTensor placements."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from chronotope.compile.rvd import RVD, Layout
from chronotope.errors import PlanError
from chronotope.graph.mask import Mask, ValueRange

SHAPE = (12, 8)


@st.composite
def layouts(draw):
    r, v = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2]))
    d = (draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from([1, 2, 4])))
    rvd = RVD(r, v, d)
    devices = draw(st.permutations(range(rvd.ndevices)))
    return Layout(rvd, tuple(devices))


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_pieces_cover_the_tensor_r_times_and_read_back_as_the_layout(layout):
    pieces = layout.pieces(SHAPE)
    assert len({d for d, _ in pieces}) == layout.rvd.ndevices
    volume = sum(m.numel * float(m.value.width) for _, m in pieces)
    assert volume == pytest.approx(layout.rvd.r * SHAPE[0] * SHAPE[1])
    assert Layout.of(pieces, SHAPE) == layout
    shape, placements, devices = layout.placements()
    assert Layout.from_placements(shape, placements, devices, len(SHAPE)) == layout


@st.composite
def meshes(draw):
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=3)))
    placements = tuple(draw(st.sampled_from([Replicate(), Partial(), Shard(0), Shard(1)]))
                       for _ in shape)
    return shape, placements


@settings(max_examples=60, deadline=None)
@given(meshes())
def test_placements_give_the_pieces_dtensor_gives_each_rank(mesh):
    shape, placements = mesh
    total = (216, 216)  # divisible however up to three axes of 2 or 3 shard it
    n = 1
    for k in shape:
        n *= k
    layout = Layout.from_placements(shape, placements, tuple(range(n)), 2)
    pieces = dict(layout.pieces(total))
    for coord in itertools.product(*(range(k) for k in shape)):
        rank = 0
        for c, k in zip(coord, shape):
            rank = rank * k + c
        local, offset = _compute_local_shape_and_global_offset(total, shape, list(coord),
                                                                placements)
        assert pieces[rank].index == tuple((o, o + s) for o, s in zip(offset, local))
        summed = any(p.is_partial() and k > 1 for k, p in zip(shape, placements))
        assert pieces[rank].value.is_full is not summed


def test_what_is_not_a_layout_reads_back_as_none():
    uneven = [(0, Mask(((0, 4), (0, 8)))), (1, Mask(((4, 12), (0, 8))))]
    assert Layout.of(uneven, SHAPE) is None
    missing = Layout(RVD(1, 2, (2, 1)), (0, 1, 2, 3)).pieces(SHAPE)[:3]
    assert Layout.of(missing, SHAPE) is None


def test_bad_layouts_are_named():
    with pytest.raises(PlanError, match="needs 4 devices"):
        Layout(RVD(1, 1, (2, 2)), (0, 1))
    with pytest.raises(PlanError, match="do not divide"):
        Layout(RVD(1, 1, (5, 1)), tuple(range(5))).pieces(SHAPE)
    assert str(RVD(1, 2, (1, 2))) == "R(1)V(2)D(1,2)"
    assert ValueRange.part(0, 2).width == ValueRange.part(1, 2).width


@pytest.mark.parametrize("code", ["Sx", "S(a)", "S(1", "X", ""])
def test_a_malformed_placement_code_is_refused_by_name(code):
    from chronotope.compile.rvd import placement, shard_dim

    with pytest.raises(PlanError, match="is no placement"):
        placement(code)
    if code.startswith("S"):
        with pytest.raises(PlanError, match="is no placement"):
            shard_dim(code)
    assert shard_dim("S(12)") == 12 and placement("S(12)") == Shard(12)
