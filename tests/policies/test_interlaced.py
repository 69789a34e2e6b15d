"""Interlaced pipeline: the shared embedding on every rank, time-shared with 1F1B stages."""

import pytest
from plan_testing import captured, trains_like_one_device

import chronotope as ct
from chronotope.policies import actions, interlaced, pipeline


@pytest.mark.parametrize("name,stages,micro", [("t5", 2, 4), ("t5", 4, 4), ("gpt", 2, 4)])
def test_interlaced_trains_like_one_device(name, stages, micro):
    w, graph = captured(name)
    plan = interlaced(graph, stages, micro)
    trains_like_one_device(w, ct.compile(plan), 2)


def test_the_table_is_spread_over_every_rank_and_time_shared():
    _, graph = captured("t5", vocab_size=8192, batch_size=8)
    plan = interlaced(graph, 4, 8)
    for steps in actions(plan).values():
        lookups = [i for i, a in enumerate(steps) if a.startswith("EF")]
        assert lookups == list(range(8))  # every lookup first
        assert steps[-1] == "TB0" and all(a.startswith(("EB", "TB")) for a in steps[-9:])
        heads = [a for a in steps if a.startswith("H")]
        assert heads == [f"H{k}{m}" for m in range(8) for k in "FB"]  # each head, then its back
    last = actions(plan)[3]
    for m in range(8):  # the last stage runs m's head between its forward and its backward
        assert last.index(f"3F{m}") < last.index(f"HF{m}") < last.index(f"3B{m}")
    table = graph.params["shared.weight"]
    table_bytes = table.shape[0] * table.shape[1] * 4
    memory = plan.check().memory
    plain = pipeline(graph, 4, 8, "1f1b").check().memory
    assert max(m.params for m in memory.values()) < max(m.params for m in plain.values())
    assert all(m.params < table_bytes for m in memory.values())  # nobody holds it whole


def test_interlaced_needs_a_shared_embedding():
    _, graph = captured("llama")
    with pytest.raises(ct.PlanError, match="shared embedding|output head"):
        interlaced(graph, 2, 2)
