"""The order search: each pipeline rank's order of its steps, by CP-SAT, within a bound on the
micro-batches' activations it keeps; the order runs as the family's own does."""

import json
import re
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from search_testing import capture

import chronotope as ct
from chronotope.cli import main
from chronotope.compile.timeline import step_times
from chronotope.errors import PlanError
from chronotope.models import get_workload
from chronotope.plan.steps import Kind
from chronotope.policies import ParallelConfig, timeline
from chronotope.policies.config import make
from chronotope.policies.pipeline import Order
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference
from chronotope.search.order import StepGraph, search_order, solve


@cache
def gpt(n_layer: int = 8, batch_size: int = 8):
    w = get_workload("gpt", n_layer=n_layer, batch_size=batch_size)
    return w, capture(w)


def equal(backward: float = 2.0):
    """Every forward, input-gradient and weight-gradient step one unit; a whole backward
    ``backward`` units."""
    return lambda rank, step: backward if re.fullmatch(r"\d+B\d+", step) else 1.0


def trains_like_one_device(w, plan, steps: int = 2) -> None:
    run = run_in_threads(ct.compile(plan), w, steps, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, steps, Optim("sgd", 0.1))).within(1e-5)


def test_a_tight_bound_turns_gpipe_into_one_f_one_b():
    """GPipe keeps every micro-batch; held to 1F1B's ``ranks - rank`` on each rank, the
    search finds 1F1B's step, which is the least such a bound allows."""
    _, graph = gpt()
    found = search_order(graph, ParallelConfig("gpipe", devices=4, micro=8),
                         step_cost=equal(), limit=[4, 3, 2, 1])
    one_f_one_b = timeline(make(graph, ParallelConfig("1f1b", devices=4, micro=8)),
                           step_cost=equal())
    assert found.given_kept == {0: 8, 1: 8, 2: 8, 3: 8}
    assert found.kept == {0: 4, 1: 3, 2: 2, 3: 1}
    assert found.makespan == one_f_one_b.makespan == 33  # (8 + 4 - 1) x (F + B)
    assert found.solved.status == "optimal"
    last = [s.action() for s in found.plan.steps[3]]
    assert last[:4] == ["3F0", "3B0", "3F1", "3B1"]  # the last stage: one in, one out


def test_split_backwards_reach_the_zero_bubble_step_by_delaying_weight_gradients():
    _, graph = gpt()
    found = search_order(graph, ParallelConfig("zb1", devices=4, micro=8),
                         step_cost=equal(), limit=5)
    assert found.makespan == 3 * 8 + 4 - 1  # ZB-H1's: no bubble but the fill
    assert all(kept <= 5 for kept in found.kept.values())
    first = found.plan.steps[0]
    delayed = [s for s in first if s.kind is Kind.W
               and first[first.index(s) - 1] != (Kind.B, s.stage, s.micro)]
    assert delayed  # some weight gradients wait for a rank's idle time


def test_on_the_plans_own_costs_the_searched_order_beats_the_hand_written_ones():
    """FLOP-priced steps are not equal (the head's stage is heavier, a weight gradient
    is not a forward): the searched order is shorter than zb1's, which is shorter than
    1F1B's, keeps no more, and trains as one device does."""
    w, graph = gpt(n_layer=4)
    found = search_order(graph, ParallelConfig("zb1", devices=4, micro=8))
    one_f_one_b = timeline(make(graph, ParallelConfig("1f1b", devices=4, micro=8)))
    assert found.makespan < 0.99 * found.given_makespan < one_f_one_b.makespan
    assert found.solved.bound <= found.makespan
    assert all(found.kept[r] <= found.given_kept[r] for r in found.kept)
    trains_like_one_device(w, found.plan)


@pytest.mark.parametrize("family,model,stages,micro", [
    ("chimera", "gpt", 4, 8),  # two pipelines, down and up
    ("3f1b", "evoformer", 4, 4),  # recycling passes without gradients, then the last
    ("zbv", "llama", 2, 4),  # two stages per rank, V-shaped
])
def test_orders_of_every_shape_stay_within_the_bound_and_train_like_one_device(
        family, model, stages, micro):
    w = get_workload(model, batch_size=micro)
    graph = capture(w)
    config = ParallelConfig(family, devices=stages, micro=micro)
    found = search_order(graph, config, seconds=5)
    assert found.makespan <= found.given_makespan * (1 + 1e-9)
    assert all(found.kept[r] <= found.limit[r] for r in found.kept)
    assert found.plan.check() is not None  # no deadlock, every step placed
    trains_like_one_device(w, found.plan)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.floats(0.2, 3.0), min_size=12, max_size=12), st.sampled_from([1, 2, 3]))
def test_any_step_times_give_an_order_that_runs_within_the_bound(times, bound):
    """Whatever the steps take, the order found plays through (no rank waits on a step
    that comes after its own next one), keeps within the bound, and is no longer than the
    given order where that one keeps within it too."""
    steps = _graph_of_zb1()
    seconds = {s: times[s.stage * 3 + "FBW".index(s.kind)] for s in steps.seconds}
    timed = StepGraph(steps.rank_of, seconds, steps.after, steps.orders)
    limit = dict.fromkeys(steps.orders, bound)
    solved = solve(timed, limit, seconds=2)
    assert all(k <= bound for k in timed.kept(solved.orders).values())
    assert solved.makespan == pytest.approx(timed.makespan(solved.orders))
    if all(k <= bound for k in timed.kept(timed.orders).values()):
        assert solved.makespan <= timed.makespan(timed.orders) * (1 + 1e-9)
    assert solved.bound <= solved.makespan * (1 + 1e-9)


@cache
def _graph_of_zb1() -> StepGraph:
    _, graph = gpt()
    return StepGraph.of(step_times(make(graph, ParallelConfig("zb1", devices=4, micro=4)),
                                   step_cost=equal()))


def test_a_bound_no_order_meets_is_refused_naming_the_rank():
    _, graph = gpt()
    with pytest.raises(PlanError, match=r"rank 0 \(0\).*raise the limit"):
        search_order(graph, ParallelConfig("1f1b", devices=4, micro=8), limit=[0, 1, 1, 1])
    with pytest.raises(PlanError, match="orders a pipeline.*not 'dp-tp'"):
        search_order(graph, ParallelConfig("dp-tp", devices=4))


def test_an_order_runs_again_from_its_csv_and_only_in_its_own_shape(tmp_path):
    _, graph = gpt()
    config = ParallelConfig("zb1", devices=4, micro=8)
    found = search_order(graph, config)
    path = str(tmp_path / "order.csv")
    found.order.write(path)
    again = make(graph, ParallelConfig("zb1", devices=4, micro=8, schedule=path))
    assert again.steps == found.plan.steps
    with pytest.raises(PlanError, match="one of the zb1 pipeline and cannot run as zbv"):
        make(graph, ParallelConfig("zbv", devices=4, micro=8, schedule=found.order))
    with pytest.raises(PlanError, match=r"runs stages \[0\] x 8 micro-batches.*x 4 there"):
        make(graph, ParallelConfig("zb1", devices=4, micro=4, schedule=found.order))
    with pytest.raises(PlanError, match="csv reads a CSV file"):
        make(graph, ParallelConfig("csv", devices=4, schedule=found.order))
    assert isinstance(found.order, Order)


@pytest.mark.slow
def test_the_cli_searches_an_order_that_trains_on_gloo_like_one_device(tmp_path, capsys):
    out = str(tmp_path / "order.csv")
    assert main(["order", "gpt", "--policy", "zb1", "--devices", "4", "--micro", "8",
                 "--batch-size", "8", "--out", out, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["makespan_s"] < report["given_makespan_s"]
    assert report["status"] == "optimal" and report["file"] == out
    w, graph = gpt(n_layer=4)
    plan = make(graph, ParallelConfig("zb1", devices=4, micro=8, schedule=out))
    run = run_processes(ct.compile(plan), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)
