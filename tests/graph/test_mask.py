"""Masks: split trees tile their tensor, intersection/containment algebra, real-tensor slicing."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chronotope.graph.mask import BoxIndex, Mask, ValueRange, VTensor, covers_exactly_once

SIZES = [1, 2, 4, 6, 8, 12]
FAST = settings(max_examples=60, deadline=None)

shapes = st.lists(st.sampled_from(SIZES), min_size=1, max_size=4).map(tuple)


@dataclass
class Tree:
    """A split tree: every node (root first) and its leaves."""

    shape: tuple[int, ...]
    nodes: list[Mask]
    leaves: list[Mask]


@st.composite
def split_trees(draw, shape_strategy=shapes, max_steps: int = 8) -> Tree:
    """Start from the full tensor and split random leaves by dim or by value, recursively."""
    shape = draw(shape_strategy)
    root = Mask.full(shape)
    nodes, leaves = [root], [root]
    for _ in range(draw(st.integers(0, max_steps))):
        k = draw(st.integers(0, len(leaves) - 1))
        leaf = leaves[k]
        splittable = [d for d, s in enumerate(leaf.shape) if s > 1]
        if splittable and draw(st.booleans()):
            dim = draw(st.sampled_from(splittable))
            size = leaf.shape[dim]
            parts = draw(st.sampled_from([p for p in range(2, size + 1) if size % p == 0]))
            children = leaf.split(dim, parts)
        else:
            children = leaf.split_value(draw(st.integers(2, 3)))
        leaves[k : k + 1] = children
        nodes.extend(children)
    return Tree(shape, nodes, leaves)


@st.composite
def masks_in(draw, shape: tuple[int, ...]) -> Mask:
    """An arbitrary non-empty box inside ``shape`` with an arbitrary value interval."""
    index = []
    for s in shape:
        a = draw(st.integers(0, s - 1))
        index.append((a, draw(st.integers(a + 1, s))))
    n = draw(st.integers(1, 6))
    i = draw(st.integers(0, n - 1))
    j = draw(st.integers(i + 1, n))
    return Mask(tuple(index), ValueRange(Fraction(i, n), Fraction(j, n)))


@st.composite
def mask_triples(draw) -> tuple[Mask, Mask, Mask]:
    shape = draw(shapes)
    return draw(masks_in(shape)), draw(masks_in(shape)), draw(masks_in(shape))


def brute_force_cover(pieces: list[Mask], shape: tuple[int, ...]) -> bool:
    """Count coverage of every element x elementary value interval (reference for small cases)."""
    cuts = sorted(
        {Fraction(0), Fraction(1)} | {p.value.lo for p in pieces} | {p.value.hi for p in pieces}
    )
    cells = [ValueRange(lo, hi) for lo, hi in itertools.pairwise(cuts)]
    for point in itertools.product(*(range(s) for s in shape)):
        for cell in cells:
            hits = sum(
                all(a <= x < b for x, (a, b) in zip(point, p.index, strict=True))
                and p.value.contains(cell)
                for p in pieces
            )
            if hits != 1:
                return False
    return True


# ---------------------------------------------------------------------------- value ranges


def test_value_part_repr_and_basics():
    half = ValueRange.part(1, 2)
    assert repr(half) == "V(1/2)"
    assert repr(ValueRange.FULL) == "V(full)"
    assert ValueRange.FULL.is_full and not half.is_full
    assert ValueRange.part(0, 1) == ValueRange.FULL
    assert ValueRange.part(2, 4) == ValueRange(Fraction(1, 2), Fraction(3, 4))
    assert ValueRange.part(2, 4).as_part() == (2, 4)
    assert repr(ValueRange(Fraction(1, 4), Fraction(3, 4))) == "V[1/4, 3/4)"
    assert ValueRange.part(0, 2).intersect(ValueRange.part(1, 2)) is None
    with pytest.raises(ValueError, match="part 3 of 2"):
        ValueRange.part(3, 2)
    with pytest.raises(ValueError):
        ValueRange(Fraction(1, 2), Fraction(1, 2))


@FAST
@given(n=st.integers(1, 12), m=st.integers(1, 6), data=st.data())
def test_nested_value_split_is_part_im_plus_j_of_nm(n, m, data):
    i = data.draw(st.integers(0, n - 1))
    parent = ValueRange.part(i, n)
    children = parent.split(m)
    assert children == [ValueRange.part(i * m + j, n * m) for j in range(m)]
    # Their union is exactly the parent: consecutive, no gap, same ends.
    assert children[0].lo == parent.lo and children[-1].hi == parent.hi
    assert all(a.hi == b.lo for a, b in itertools.pairwise(children))
    assert all(parent.contains(c) for c in children)
    assert sum(c.width for c in children) == parent.width
    # The same holds through masks.
    mask = Mask(((0, 4),), parent)
    assert [c.value for c in mask.split_value(m)] == children
    assert covers_exactly_once(
        mask.split_value(m)
        + Mask.full((4,)).split_value(n)[:i]
        + Mask.full((4,)).split_value(n)[i + 1 :],
        (4,),
    )


# ----------------------------------------------------------------------------- tilings


@FAST
@given(tree=split_trees())
def test_split_tree_leaves_cover_exactly_once(tree):
    assert covers_exactly_once(tree.leaves, tree.shape)
    assert covers_exactly_once(reversed(tree.leaves), tree.shape)


@FAST
@given(tree=split_trees(), data=st.data())
def test_removing_or_duplicating_a_leaf_breaks_the_cover(tree, data):
    k = data.draw(st.integers(0, len(tree.leaves) - 1))
    leaves = tree.leaves
    assert not covers_exactly_once(leaves[:k] + leaves[k + 1 :], tree.shape)
    assert not covers_exactly_once(leaves + [leaves[k]], tree.shape)
    # Also broken: adding any other node of the tree (it overlaps some leaf).
    extra = data.draw(st.sampled_from(tree.nodes))
    assert not covers_exactly_once(leaves + [extra], tree.shape)


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_cover_agrees_with_brute_force(shape, data):
    # Mix of a real tiling, perturbed tilings and arbitrary boxes, so both answers occur.
    tree = data.draw(split_trees(st.just(shape), max_steps=4))
    pieces = list(tree.leaves)
    if data.draw(st.booleans()):
        pieces.pop(data.draw(st.integers(0, len(pieces) - 1)))
    if data.draw(st.booleans()):
        pieces.append(data.draw(masks_in(shape)))
    if data.draw(st.booleans()):
        pieces = data.draw(st.lists(masks_in(shape), min_size=1, max_size=4))
    assert covers_exactly_once(pieces, shape) == brute_force_cover(pieces, shape)


def test_cover_edge_cases():
    assert covers_exactly_once([Mask.full(())], ())
    assert covers_exactly_once(Mask.full(()).split_value(3), ())
    assert not covers_exactly_once([], (2,))
    assert not covers_exactly_once([Mask.full((4,))], (2,))  # sticks out
    assert not covers_exactly_once([Mask(((0, 2),))], (4,))  # gap
    with pytest.raises(ValueError, match="dims"):
        covers_exactly_once([Mask.full((2, 2))], (2,))


def test_cover_scales_to_many_pieces():
    pieces = [m for row in Mask.full((64, 64)).split(0, 64) for m in row.split(1, 64)]
    assert len(pieces) == 4096
    assert covers_exactly_once(pieces, (64, 64))
    assert not covers_exactly_once(pieces + [pieces[1234]], (64, 64))


@settings(max_examples=150, deadline=None)
@given(shape=st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=0, max_size=3).map(tuple),
       data=st.data())
def test_box_index_finds_every_overlapping_piece(shape, data):
    # Tilings, their nodes, and arbitrary boxes (some empty), queried with any box.
    tree = data.draw(split_trees(st.just(shape), max_steps=4))
    pieces = data.draw(st.sampled_from([tree.leaves, tree.nodes]))
    pieces = pieces + data.draw(st.lists(masks_in(shape), max_size=4))
    pieces = [Mask(m.index) for m in pieces]
    boxes = BoxIndex([m.index for m in pieces])
    for query in data.draw(st.lists(masks_in(shape), min_size=1, max_size=4)):
        want = [k for k, m in enumerate(pieces) if m.overlaps(Mask(query.index))]
        assert boxes.overlapping(query.index) == want


# ------------------------------------------------------------------------ mask algebra


@settings(max_examples=200, deadline=None)
@given(masks=mask_triples())
def test_intersection_algebra(masks):
    a, b, _ = masks
    ab, ba = a.intersect(b), b.intersect(a)
    assert ab == ba
    assert a.intersect(a) == a
    assert a.overlaps(b) == (ab is not None) == b.overlaps(a)
    if ab is not None:
        assert a.contains(ab) and b.contains(ab)
        assert ab.intersect(a) == ab
        # Largest common box: anything inside both is inside the intersection.
        for m in (a, b):
            if a.contains(m) and b.contains(m):
                assert ab.contains(m)


@settings(max_examples=200, deadline=None)
@given(masks=mask_triples())
def test_intersection_matches_elementwise_sets(masks):
    a, b, _ = masks

    def elements(m: Mask) -> set[tuple[int, ...]]:
        return set(itertools.product(*(range(x, y) for x, y in m.index)))

    ab = a.intersect(b)
    common = elements(a) & elements(b)
    value = a.value.intersect(b.value)
    if not common or value is None:
        assert ab is None
    else:
        assert elements(ab) == common and ab.value == value


@settings(max_examples=200, deadline=None)
@given(masks=mask_triples())
def test_containment_partial_order_on_random_masks(masks):
    a, b, c = masks
    assert a.contains(a)
    if a.contains(b) and b.contains(a):
        assert a == b
    if a.contains(b) and b.contains(c):
        assert a.contains(c)
    # Build a guaranteed chain a >= b' >= c' and check transitivity on it.
    b2 = a.intersect(b)
    c2 = b2.intersect(c) if b2 is not None else None
    if c2 is not None:
        assert a.contains(b2) and b2.contains(c2) and a.contains(c2)


@settings(max_examples=40, deadline=None)
@given(tree=split_trees(max_steps=6))
def test_containment_partial_order_on_split_tree(tree):
    nodes = tree.nodes
    contains = {
        (i, j): nodes[i].contains(nodes[j]) for i in range(len(nodes)) for j in range(len(nodes))
    }
    for i, j in contains:
        if i == j:
            assert contains[i, j]
        if contains[i, j] and contains[j, i]:
            assert nodes[i] == nodes[j]
    for i, j, k in itertools.product(range(len(nodes)), repeat=3):
        if contains[i, j] and contains[j, k]:
            assert contains[i, k]
    # Every node contains exactly the leaves that were cut from it.
    for node in nodes:
        inside = [leaf for leaf in tree.leaves if node.contains(leaf)]
        assert covers_exactly_once(inside, tree.shape) == (node == nodes[0])
        assert sum(leaf.numel * leaf.value.width for leaf in inside) == (
            node.numel * node.value.width
        )


def test_different_ndim_is_an_error():
    with pytest.raises(ValueError, match="ndim"):
        Mask.full((2,)).intersect(Mask.full((2, 2)))


# ------------------------------------------------------------------------ real tensors


@FAST
@given(tree=split_trees(), data=st.data())
def test_local_slices_round_trip(tree, data):
    full = torch.arange(math.prod(tree.shape)).reshape(tree.shape)
    container = data.draw(st.sampled_from(tree.nodes))
    inside = [n for n in tree.nodes if container.contains(n)]
    inner = data.draw(st.sampled_from(inside))
    local = full[container.to_slices()]
    assert local.shape == container.shape
    piece = local[inner.local_slices(container)]
    assert piece.shape == inner.shape
    assert torch.equal(piece, full[inner.to_slices()])
    assert inner.local_slices(inner) == tuple(slice(0, s) for s in inner.shape)


@FAST
@given(tree=split_trees())
def test_leaves_with_scaled_values_sum_back_to_the_tensor(tree):
    full = torch.rand(tree.shape, dtype=torch.float64)
    rebuilt = torch.zeros_like(full)
    for leaf in tree.leaves:
        rebuilt[leaf.to_slices()] += full[leaf.to_slices()] * float(leaf.value.width)
    torch.testing.assert_close(rebuilt, full)


@FAST
@given(shape=shapes, data=st.data())
def test_dim_split_concatenates_back(shape, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    parts = data.draw(st.sampled_from([p for p in range(1, shape[dim] + 1) if shape[dim] % p == 0]))
    full = torch.arange(math.prod(shape)).reshape(shape)
    root = Mask.full(shape)
    chunks = root.split(dim, parts)
    assert torch.equal(torch.cat([full[c.local_slices(root)] for c in chunks], dim), full)
    assert [c.shape[dim] for c in chunks] == [shape[dim] // parts] * parts


def test_local_slices_refuses_a_piece_outside():
    with pytest.raises(ValueError, match="not inside"):
        Mask(((0, 4),)).local_slices(Mask(((2, 6),)))
    # Only the index part matters for slicing: a full-value region inside a partial piece.
    assert Mask(((2, 4),)).local_slices(Mask(((0, 8),), ValueRange.part(0, 2))) == (slice(2, 4),)


# ----------------------------------------------------------------------- errors, text


def test_split_error_names_dim_and_sizes():
    with pytest.raises(ValueError, match=r"dim 1 of size 6 into 4"):
        Mask.full((8, 6)).split(1, 4)
    with pytest.raises(ValueError, match=r"dim 1 of size 6 into 4"):
        Mask.full((8, 6)).split(-1, 4)
    with pytest.raises(ValueError, match="out of range"):
        Mask.full((8, 6)).split(2, 2)


def test_str_and_shape():
    m = Mask(((0, 4), (8, 16)), ValueRange.part(1, 2))
    assert str(m) == "[0:4, 8:16] V(1/2)"
    assert str(Mask.full((3,))) == "[0:3]"
    assert str(Mask.full(())) == "[]"
    assert m.shape == (4, 8) and m.ndim == 2 and m.numel == 32
    assert m.to_slices() == (slice(0, 4), slice(8, 16))


@dataclass(frozen=True)
class FakeTensor:
    name: str
    shape: tuple[int, ...]


def test_vtensor():
    x, y = FakeTensor("x", (8, 6)), FakeTensor("y", (8, 6))
    a = VTensor(x, Mask(((0, 4), (0, 6)), ValueRange.part(1, 2)))
    b = VTensor(x, Mask(((2, 8), (0, 6))))
    assert str(a) == "x[0:4, :] V(1/2)"
    assert str(VTensor("w", Mask.full((2,)))) == "w[0:2]"
    assert a.shape == (4, 6)
    assert a.overlaps(b)
    assert a.intersect(b) == VTensor(x, Mask(((2, 4), (0, 6)), ValueRange.part(1, 2)))
    other = VTensor(y, b.mask)
    assert not a.overlaps(other) and a.intersect(other) is None
    assert len({a, VTensor(x, a.mask)}) == 1
