"""Searched layout changes: they reproduce the target layout value for value, and cost
no more than plain messages under the cost model."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chronotope.compile.rvd import RVD, Layout
from chronotope.compile.rvd_search import intra_steps, normal, p2p, search
from chronotope.cost.network import load_cluster
from chronotope.errors import PlanError
from chronotope.runtime.redistribute import pieces_of, run_paths, run_paths_in_threads

SHAPE = (8, 12)
RVDS = [RVD(r, v, (a, b)) for r in (1, 2, 4) for v in (1, 2, 4) for a in (1, 2, 4)
        for b in (1, 2, 3) if r * v * a * b <= 8]


@st.composite
def layout_changes(draw):
    src, dst = draw(st.sampled_from(RVDS)), draw(st.sampled_from(RVDS))
    same = draw(st.booleans())
    devices = draw(st.permutations(range(8)))
    a = tuple(draw(st.permutations(devices[:src.ndevices])))
    b = tuple(draw(st.permutations(devices[:dst.ndevices] if same else devices[-dst.ndevices:])))
    return Layout(src, a), Layout(dst, b)


def value_parts(layout: Layout, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-8, 8, SHAPE, generator=g).float() for _ in range(layout.rvd.v)]


def assert_holds(layout: Layout, got: dict[int, torch.Tensor], whole: torch.Tensor) -> None:
    """Every device holds its piece: replicas equal, value parts summing to the whole."""
    by_index: dict[tuple, dict] = {}
    for device, mask in layout.pieces(SHAPE):
        assert device in got, f"device {device} of {layout} got nothing"
        assert tuple(got[device].shape) == mask.shape
        by_index.setdefault(mask.index, {}).setdefault(mask.value, []).append(got[device])
    for index, values in by_index.items():
        total = 0
        for replicas in values.values():
            assert all(torch.equal(replicas[0], x) for x in replicas)
            total = total + replicas[0]
        expect = whole[tuple(slice(a, b) for a, b in index)]
        assert torch.equal(total, expect), (layout, index)
        if layout.rvd.v == 1:
            assert torch.equal(next(iter(values.values()))[0], expect)


@settings(max_examples=40, deadline=None)
@given(layout_changes(), st.integers(0, 2 ** 16))
def test_a_searched_path_makes_the_target_layout_exactly(change, seed):
    src, dst = change
    path = search(src, dst, SHAPE, 4, "dgx1-v100")
    parts = value_parts(src, seed)
    got = run_paths_in_threads(path, SHAPE, pieces_of(src, parts))
    assert_holds(dst, got, sum(parts))
    assert path.seconds <= p2p(src, dst, SHAPE, 4, "dgx1-v100").seconds * (1 + 1e-9)


def test_the_paper_example_finds_a_cheaper_route_than_the_papers():
    """R(1)V(2)D(1,2) to R(2)V(1)D(2,1): the paper's figure all-reduces then all-to-alls
    (1.5 pieces over each link); a reduce-scatter then an all-gather moves 0.75."""
    src = Layout(RVD(1, 2, (1, 2)), (0, 1, 2, 3))
    dst = Layout(RVD(2, 1, (2, 1)), (0, 2, 1, 3))
    path = search(src, dst, (1024, 1024), 4, "dgx-a100")
    assert [s.kind for s in path.steps] == ["reduce_scatter", "all_gather"]
    steps = intra_steps(normal(src), (1024, 1024), 4, load_cluster("dgx-a100"))
    reduce = next(s for s in steps if s.kind == "all_reduce" and s.after.rvd == RVD(2, 1, (1, 2)))
    swap = next(s for s in intra_steps(reduce.after, (1024, 1024), 4, load_cluster("dgx-a100"))
                if s.kind == "all_to_all" and s.after.rvd == dst.rvd)
    assert path.seconds < reduce.seconds + swap.seconds


def test_across_nodes_rvd_sends_each_byte_over_the_network_once():
    """Replicas on one node to replicas on another: cut, move the cuts, gather there."""
    cluster = load_cluster("dgx1-v100x2")
    src = Layout(RVD(8, 1, (1,)), tuple(range(8)))
    dst = Layout(RVD(8, 1, (1,)), tuple(range(8, 16)))
    path = search(src, dst, (2 ** 26,), 4, cluster)
    assert [s.kind for s in path.steps] == ["chunk", "send", "all_gather"]
    assert path.seconds * 4 < p2p(src, dst, (2 ** 26,), 4, cluster).seconds


def test_a_change_whole_nodes_further_on_is_the_same_path_moved():
    """The nodes are alike (DGX-1's uneven NVLinks included), so the layout changes between
    later pipeline stages are found once, on the first nodes, and moved."""
    cluster = load_cluster("dgx1-v100x4")
    src = Layout(RVD(1, 2, (1, 4)), (0, 2, 4, 6, 1, 3, 5, 7))
    dst = Layout(RVD(2, 1, (4, 1)), tuple(range(8, 16)))
    path = search(src, dst, (1024, 1024), 4, cluster)
    later = search(src.moved(16), dst.moved(16), (1024, 1024), 4, cluster)
    assert later == path.moved(16) and len(path.steps) > 1


def test_value_parts_that_do_not_nest_are_first_summed():
    src, dst = Layout(RVD(1, 2, (1, 1)), (0, 1)), Layout(RVD(1, 3, (1, 1)), (0, 1, 2))
    with pytest.raises(PlanError, match="do not nest"):
        p2p(src, dst, SHAPE)
    path = search(src, dst, SHAPE)
    parts = value_parts(src, 0)
    assert_holds(dst, run_paths_in_threads(path, SHAPE, pieces_of(src, parts)), sum(parts))


def test_bad_layouts_are_named():
    with pytest.raises(PlanError, match="not in cluster dgx-a100"):
        search(Layout(RVD(1, 1, (2, 1)), (0, 9)), Layout(RVD(2, 1, (1, 1)), (0, 1)), SHAPE,
               cluster="dgx-a100")
    with pytest.raises(PlanError, match="two pieces on one device"):
        search(Layout(RVD(1, 1, (2, 1)), (0, 0)), Layout(RVD(2, 1, (1, 1)), (0, 1)), SHAPE)
    with pytest.raises(PlanError, match="do not divide"):
        search(Layout(RVD(1, 1, (1, 5)), tuple(range(5))), Layout(RVD(1, 1, (1, 1)), (0,)),
               SHAPE)


@pytest.mark.slow
def test_searched_paths_make_the_target_layout_on_gloo():
    """Random layout changes over up to 8 processes, carried out by gloo collectives."""
    import random
    rng = random.Random(7)
    paths, sources, expect = [], [], []
    for k in range(10):
        src, dst = rng.choice(RVDS), rng.choice(RVDS)
        a = tuple(rng.sample(range(8), src.ndevices))
        b = a[:dst.ndevices] if len(a) >= dst.ndevices and k % 2 else \
            tuple(rng.sample(range(8), dst.ndevices))
        path = search(Layout(src, a), Layout(dst, b), SHAPE)
        parts = value_parts(path.src, k)
        paths.append(path)
        sources.append(pieces_of(path.src, parts))
        expect.append(sum(parts))
    outputs, _ = run_paths(paths, SHAPE, sources, timeout=60)
    for path, got, whole in zip(paths, outputs, expect):
        assert_holds(path.dst, got, whole)
