"""The search's cost models against the simulator: the step time each predicts for the
points and options it chooses among is within 15% of the compiled plan's simulated step,
on one node and across two (where data-parallel groups of every pipeline stage share the
nodes' network)."""

import warnings
from dataclasses import replace

import pytest

import chronotope as ct
from chronotope.compile.simulate import simulate
from chronotope.cost.network import Link, cluster_for
from chronotope.models import get_workload
from chronotope.search import _Clock, _pipeline_plan, ilp_options, solution_plan
from chronotope.search.knobs import Knobs, Model
from chronotope.search.stages import Pipeline

TOLERANCE = 0.15
ONE_NODE = cluster_for(8, "dgx-a100")
TWO_NODES = replace(ONE_NODE, name="two nodes of 4 on a slow network", per_node=4, nodes=2,
                    inter=Link(1e-5, 2.5e9))


def meta(batch_size: int) -> ct.Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(get_workload("gpt3-1.3b", device="meta", batch_size=batch_size,
                                       n_layer=4), check_up_to=0)


def simulated(plan: ct.Plan, cluster) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return simulate(ct.compile(plan, cluster=cluster), cluster).step_time


POINTS = [Knobs(8, 1, 1, 1), Knobs(2, 4, 1, 2), Knobs(1, 8, 1, 1), Knobs(2, 1, 4, 4),
          Knobs(2, 1, 4, 4, chunks=2), Knobs(4, 1, 2, 4, shard=True),
          Knobs(2, 2, 2, 4, recompute="full"), Knobs(1, 4, 2, 4, sequence=True),
          Knobs(8, 1, 1, 1, zero3=True), Knobs(4, 2, 1, 1, zero3=True),
          Knobs(2, 4, 1, 1, zero3=True), Knobs(2, 1, 4, 4, zero_bubble=True)]


@pytest.mark.parametrize("cluster", [ONE_NODE, TWO_NODES], ids=["one node", "two nodes"])
def test_the_mesh_familys_model_prices_each_point_within_15_percent_of_the_simulator(cluster):
    graph = meta(16)
    model = Model(graph, cluster, "fp32")
    for knobs in POINTS:
        plan = knobs.plan(graph, "fp32", lambda r: meta(16 // r))
        ratio = model.price(knobs).seconds / simulated(plan, cluster)
        assert 1 - TOLERANCE < ratio < 1 + TOLERANCE, (knobs.label, ratio)


@pytest.mark.parametrize("cluster", [ONE_NODE, TWO_NODES], ids=["one node", "two nodes"])
def test_the_ilp_and_the_stage_dp_price_their_options_within_15_percent_of_the_simulator(
        cluster):
    graph = meta(16)
    options, _ = ilp_options(graph, 8, cluster, cluster.memory, 30.0)
    kinds = {isinstance(option, Pipeline) for _, option in options}
    assert kinds == {True, False}  # meshes and pipelines both
    for seconds, option in options:
        if isinstance(option, Pipeline):
            _, plan, _ = _pipeline_plan(graph, option, None, _Clock())
            label = option.label
        else:
            plan = solution_plan(graph, option[0])
            label = f"mesh {option[0].mesh}"
        ratio = seconds / simulated(plan, cluster)
        assert 1 - TOLERANCE < ratio < 1 + TOLERANCE, (label, ratio)
