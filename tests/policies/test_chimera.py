"""Chimera: a down and an up pipeline over the same ranks fill each other's bubbles."""

import pytest
from plan_testing import captured, trains_like_one_device

import chronotope as ct
from chronotope.policies import actions, pipeline, timeline
from chronotope.policies.pipeline import chimera


@pytest.mark.parametrize("name,stages,micro", [("gpt", 2, 4), ("bert", 4, 4)])
def test_chimera_trains_like_one_device(name, stages, micro):
    w, graph = captured(name, n_layer=4, batch_size=8)
    plan = pipeline(graph, stages, micro, "chimera")
    trains_like_one_device(w, ct.compile(plan), 2)


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8)])
def test_chimera_holds_both_directions_and_waits_less_than_one_f_one_b(stages, micro):
    _, graph = captured("gpt", n_layer=4, batch_size=8)
    plan = pipeline(graph, stages, micro, "chimera")
    held = {r: sorted({int(a[:-2]) for a in steps}) for r, steps in actions(plan).items()}
    assert held == {r: [r, 2 * stages - 1 - r] for r in range(stages)}
    for r in range(stages):  # every step once: half the micro-batches each way
        assert sorted(chimera(r, stages, micro)) == sorted(
            (k, s, m) for k in "FB" for s in (r, 2 * stages - 1 - r) for m in range(micro // 2))
    cost = {"F": 1.0, "B": 2.0}
    bubble = {name: timeline(pipeline(graph, stages, micro, name),
                             step_cost=lambda rank, step: cost[step.strip("0123456789")]
                             ).bubble_ratio for name in ("chimera", "1f1b")}
    assert bubble["chimera"] < bubble["1f1b"], bubble


def test_chimera_needs_an_even_number_of_micro_batches():
    _, graph = captured("gpt", n_layer=4, batch_size=6)
    with pytest.raises(ct.PlanError, match="even number of micro-batches"):
        pipeline(graph, 2, 3, "chimera")
