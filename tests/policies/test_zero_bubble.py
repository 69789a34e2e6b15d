"""Zero-bubble pipelines: backwards split into input and weight gradients, W fills idle time."""

from types import SimpleNamespace

import pytest
from plan_testing import captured, trains_like_one_device
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

import chronotope as ct
from chronotope.policies import actions, mesh, pipeline, read_schedule, timeline
from chronotope.policies.pipeline import zb1, zbv


@pytest.mark.parametrize("name,schedule,stages,micro,chunks", [
    ("gpt", "zb1", 2, 4, 1),
    ("llama", "zbv", 2, 4, 2),
])
def test_zero_bubble_trains_like_one_device(name, schedule, stages, micro, chunks):
    w, graph = captured(name, n_layer=4)
    plan = pipeline(graph, stages, micro, schedule, chunks=chunks)
    assert any(plan.weight_op(op) for op in plan.forward_leaves())
    trains_like_one_device(w, ct.compile(plan))


def test_split_backward_without_a_pipeline_trains_like_one_device():
    w, graph = captured("gpt")
    plan = ct.Plan(graph, 2)
    for op in graph:
        plan.assign(op, 0 if op.name < "linear_3" else 1)
    plan.split_backward(plan.forward_leaves())
    program = ct.compile(plan)
    code = program.code(0) + program.code(1)
    assert code.count("rt.weight(") == sum(plan.weight_op(op) is not None
                                           for op in plan.forward_leaves())
    trains_like_one_device(w, program)


@pytest.mark.parametrize("ranks,micro", [(2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (4, 16)])
def test_zb1_reaches_the_zero_bubble_step_with_one_f_one_b_memory(ranks, micro):
    """With equal F, B and W times: 3m + p - 1 steps (1F1B: 3(m + p - 1)), every step once,
    B after F, W after B, and at most p + 1 micro-batches waiting for their W."""
    for r in range(ranks):
        steps = zb1(r, ranks, micro)
        assert sorted(steps) == sorted((k, r, m) for k in "FBW" for m in range(micro))
        seen, kept = set(), 0
        for kind, _, m in steps:
            assert kind == "F" or ({"B": "F", "W": "B"}[kind], r, m) in seen
            seen.add((kind, r, m))
            kept += {"F": 1, "B": 0, "W": -1}[kind]
            assert kept <= ranks + 1
    _, graph = captured("gpt", n_layer=ranks, batch_size=micro)
    plan = pipeline(graph, ranks, micro, "zb1")
    one = timeline(plan, step_cost=lambda rank, step: 1.0)
    assert one.makespan == 3 * micro + ranks - 1
    assert actions(plan) == {r: [f"{s}{'I' if k == 'B' else k}{m}" for k, s, m in
                                 zb1(r, ranks, micro)] for r in range(ranks)}
    unsplit = timeline(pipeline(graph, ranks, micro, "1f1b"),
                       step_cost=lambda rank, step: 2.0 if "B" in step else 1.0)
    assert unsplit.makespan == 3 * (micro + ranks - 1)


def test_zbv_places_stages_down_and_back_up_and_beats_zb1():
    _, graph = captured("gpt", n_layer=8, batch_size=8)
    plan = pipeline(graph, 4, 8, "zbv", chunks=2)
    held = {r: sorted({int(a[0]) for a in steps}) for r, steps in actions(plan).items()}
    assert held == {0: [0, 7], 1: [1, 6], 2: [2, 5], 3: [3, 4]}
    assert sorted(zbv(0, 4, 8)) == sorted((k, s, m) for k in "FBW" for s in (0, 7)
                                          for m in range(8))
    # equal steps; a zbv stage is half a zb1 stage
    equal = {name: timeline(pipeline(graph, 4, 8, name, chunks=c),
                            step_cost=lambda rank, step, cost=cost: cost)
             for name, c, cost in (("zb1", 1, 1.0), ("zbv", 2, 0.5))}
    assert equal["zbv"].bubble_ratio < equal["zb1"].bubble_ratio


def torch_zbv(ranks: int, micro: int) -> dict[int, list[str]]:
    """torch's ScheduleZBVZeroBubble order, idle steps left out."""
    fake = SimpleNamespace(pp_group_size=ranks, _n_microbatches=micro, num_stages=2 * ranks)
    return {r: [str(a) for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, r)
                if a is not None] for r in range(ranks)}


def test_torch_zbv_csv_becomes_the_plan_order_and_trains(tmp_path):
    w, graph = captured("gpt", n_layer=4, batch_size=4)
    want = torch_zbv(2, 4)
    path = tmp_path / "zbv.csv"
    path.write_text("".join(",".join(want[r]) + "\n" for r in sorted(want)))
    schedule, _ = read_schedule(str(path))
    plan = pipeline(graph, 2, 4, schedule, chunks=2)
    assert actions(plan) == want
    trains_like_one_device(w, ct.compile(plan))


def test_split_backward_errors_name_the_op():
    _, graph = captured("gpt")
    plan = mesh(graph, dp=2)
    with pytest.raises(ct.PlanError, match="backward op: split its forward op"):
        plan.split_backward(plan.backward("linear"))
    plan.check()
    with pytest.raises(ct.PlanError, match="already made"):
        plan.split_backward("linear")
    with pytest.raises(ct.PlanError, match="zbv runs two stages per rank"):
        pipeline(graph, 2, 2, "zbv", chunks=3)
