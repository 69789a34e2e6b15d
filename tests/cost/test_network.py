"""The alpha-beta cost model: presets, rings, concurrent messages, profile files."""

import json
from dataclasses import replace

import pytest

from chronotope.cost.network import Cluster, ClusterError, Link, load_cluster, steps_and_volume
from chronotope.measure.profile import fit, profile, save_profile


def test_a_dgx1_ring_of_eight_uses_the_double_nvlinks():
    dgx1 = load_cluster("dgx1-v100")
    assert dgx1.ring(tuple(range(8))).bandwidth == 50e9  # 0-3-2-1-5-6-7-4-0
    assert dgx1.link(0, 5).bandwidth == 10e9  # no NVLink between them: PCIe
    assert dgx1.ring((0, 5)).bandwidth == 10e9
    assert dgx1.ring((0, 1, 2, 3)).bandwidth == 25e9  # 0-1 and 1-3 are single links


def test_collectives_follow_the_ring_formulas():
    a100 = load_cluster("dgx-a100")
    n = 2 ** 30
    assert a100.collective("all_reduce", n, [tuple(range(8))]) == pytest.approx(
        14 * a100.intra.alpha + 2 * 7 / 8 * n / 300e9 + a100.call)
    assert a100.collective("all_gather", n, [(0, 1)]) == pytest.approx(
        a100.intra.alpha + n / 2 / 300e9 + a100.call)
    assert steps_and_volume("all_to_all", 1) == (0.0, 0.0)


def test_groups_crossing_nodes_share_the_network():
    two = load_cluster("h100-sxmx2")
    assert two.ndevices == 16 and two.node(9) == 1
    one = two.collective("all_reduce", 2 ** 28, [(0, 8)])
    both = two.collective("all_reduce", 2 ** 28, [(0, 8), (1, 9)])
    assert both > 1.9 * one - 1e-3
    alone = two.transfer([(0, 8, 2 ** 28)])
    assert two.transfer([(0, 8, 2 ** 28), (1, 9, 2 ** 28)]) == pytest.approx(
        2 * alone - two.inter.alpha - two.call, rel=1e-6)
    assert two.transfer([(0, 1, 2 ** 28), (2, 3, 2 ** 28)]) == pytest.approx(
        two.transfer([(0, 1, 2 ** 28)]))  # NVSwitch: separate pairs do not wait


def test_unknown_clusters_and_bad_files_are_named(tmp_path):
    with pytest.raises(ClusterError, match="dgx1-v100, dgx-a100, h100-sxm"):
        load_cluster("tpu-v5")
    bad = tmp_path / "c.json"
    bad.write_text("{")
    with pytest.raises(ClusterError, match="not JSON"):
        load_cluster(str(bad))
    bad.write_text("{}")
    with pytest.raises(ClusterError, match="chronotope profile"):
        load_cluster(str(bad))
    with pytest.raises(ClusterError, match="cannot read"):
        load_cluster(str(tmp_path / "missing.json"))


def test_fit_recovers_alpha_and_bandwidth():
    sizes = (1000, 10_000, 100_000)
    seconds = [3 * 2e-5 + n * (3 / 4) / 1e9 for n in sizes]  # an all-gather over 4 members
    link = fit("all_gather", 4, sizes, seconds)
    assert link.alpha == pytest.approx(2e-5) and link.bandwidth == pytest.approx(1e9)


@pytest.mark.slow
def test_profile_measures_every_collective_and_loads_back(tmp_path):
    cluster = profile(2, sizes=(2 ** 12, 2 ** 16, 2 ** 20), repeats=2)
    assert set(cluster.fitted) >= {"send", "all_reduce", "all_gather", "reduce_scatter",
                                   "all_to_all", "broadcast"}
    assert all(link.bandwidth > 0 and link.alpha >= 0 for link in cluster.fitted.values())
    assert cluster.peak() > 0 and cluster.copy_bandwidth > 0 and cluster.memory > 0
    path = tmp_path / "cluster.json"
    save_profile(cluster, str(path))
    assert load_cluster(str(path)) == cluster
    assert json.loads(path.read_text())["per_node"] == 2
    assert set(cluster.fitted_busy) == set(cluster.fitted) and cluster.busy > 0
    assert 0.0 <= cluster.overlap <= 1.0
    for fitted, busy in ((cluster.fitted, 0.0), (cluster.fitted_busy, cluster.busy)):
        link = fitted["all_reduce"]
        assert cluster.collective("all_reduce", 2 ** 20, [(0, 1)], busy) == pytest.approx(
            2 * link.alpha + 2 ** 20 / link.bandwidth)


def test_a_profiled_call_is_priced_by_the_compute_before_it():
    base = load_cluster("dgx-a100")
    cluster = replace(base, name="here", fitted={"all_gather": Link(1e-4, 1e9)},
                      fitted_busy={"all_gather": Link(3e-4, 0.5e9)}, busy=2e-3)
    back_to_back = 1e-4 + 2 ** 20 / 2 / 1e9
    after = 3e-4 + 2 ** 20 / 2 / 0.5e9
    assert cluster.measured("all_gather", 2 ** 20, 2) == pytest.approx(back_to_back)
    assert cluster.measured("all_gather", 2 ** 20, 2, busy=1e-3) == pytest.approx(
        (back_to_back + after) / 2)
    assert cluster.measured("all_gather", 2 ** 20, 2, busy=1.0) == pytest.approx(after)
    assert Cluster.from_json(cluster.to_json()) == cluster
