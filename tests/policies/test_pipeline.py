"""Pipeline schedules written as op_order: torch's orders, one-device results, deadlocks."""

from types import SimpleNamespace

import pytest
from plan_testing import captured, trains_like_one_device
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import chronotope as ct
from chronotope.policies import actions, pipeline, read_schedule

TORCH = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

def torch_order(schedule: str, stages: int, micro: int) -> dict[int, list[str]]:
    """The order torch's own schedule runs each stage's micro-batches in: its
    ``_step_microbatches`` loop driven with a stage that only records the calls.
    (Its ``pipeline_order`` IR numbers the last stage's 1F1B forwards from 1, while the
    loop runs micro-batch 0 first, so the loop is the reference.)"""
    out = {}
    for s in range(stages):
        steps: list[str] = []
        stage = SimpleNamespace(
            stage_index=s, is_first=s == 0, is_last=s == stages - 1,
            forward_one_chunk=lambda mb, *a, s=s, steps=steps, **k: steps.append(f"{s}F{mb}"),
            backward_one_chunk=lambda mb, s=s, steps=steps, **k: steps.append(f"{s}B{mb}"),
            get_fwd_recv_ops=lambda mb: [], get_fwd_send_ops=lambda mb: [],
            get_bwd_recv_ops=lambda mb: [], get_bwd_send_ops=lambda mb: [],
            perform_reduce_grad=lambda n: None)
        fake = SimpleNamespace(
            _stage=stage, _n_microbatches=micro, _num_stages=stages, scale_grads=True,
            _has_backward=True,
            _check_inputs=lambda a, k, t, losses: ([()] * micro, [{}] * micro),
            _initialize_stage=lambda *a: None, _maybe_compute_loss=lambda *a: None,
            _maybe_get_loss=lambda *a: None, _update_losses=lambda *a: None)
        TORCH[schedule]._step_microbatches(fake)
        out[s] = steps
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_orders_equal_torch_pipelining(schedule, stages, micro):
    _, graph = captured("gpt", n_layer=4, batch_size=8)
    plan = pipeline(graph, stages, micro, schedule)
    assert actions(plan) == torch_order(schedule, stages, micro)


@pytest.mark.parametrize("name,schedule,stages,micro", [
    ("gpt", "1f1b", 2, 4), ("llama", "1f1b", 2, 2), ("bert", "gpipe", 2, 2),
    ("gpt", "1f1b", 4, 4),
])
def test_schedules_train_like_one_device(name, schedule, stages, micro):
    w, graph = captured(name)
    trains_like_one_device(w, ct.compile(pipeline(graph, stages, micro, schedule)), 3)


def test_one_f_one_b_keeps_fewer_micro_batches_alive_than_gpipe():
    _, graph = captured("gpt", n_layer=4, batch_size=8)
    peak = {s: pipeline(graph, 4, 8, s).check().memory[0].activations
            for s in ("gpipe", "1f1b")}
    assert peak["1f1b"] < peak["gpipe"]


def test_data_parallel_pipelines_each_follow_the_schedule():
    w, graph = captured("gpt")
    plan = pipeline(graph, 2, 2, "1f1b", dp=2)
    order = actions(plan)
    assert order[0] == order[2] == ["0F0", "0F1", "0B0", "0B1"]
    assert order[1] == order[3] == ["1F0", "1B0", "1F1", "1B1"]
    trains_like_one_device(w, ct.compile(plan), 2)


def test_an_order_that_waits_on_its_own_later_forward_is_rejected():
    _, graph = captured("gpt", n_layer=4, batch_size=8)
    plan = pipeline(graph, 2, 2, "gpipe")
    first = plan.group(plan.cells[(0, 0, 0)], "F0.0")
    second = plan.group(plan.cells[(0, 0, 1)], "F0.1")
    # Stage 0 would run micro-batch 0's backward before micro-batch 1's forward, but
    # also micro-batch 1's forward before micro-batch 0's backward (from gpipe): a cycle.
    plan.order(plan.backward(first), second)
    with pytest.raises(ct.DeadlockError, match=r"F0\.1|backward\(F0\.0\)"):
        plan.check()


def torch_interleaved(stages: int, micro: int, chunks: int) -> dict[int, list[str]]:
    """torch's ScheduleInterleaved1F1B order (what its runtime executes), bubbles left out."""
    rounds = max(1, micro // stages)
    fake = SimpleNamespace(n_local_stages=chunks, pp_group_size=stages, _n_microbatches=micro,
                           microbatches_per_round=micro // rounds)
    return {r: [str(a) for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(
        fake, r) if a is not None] for r in range(stages)}


@pytest.mark.parametrize("stages,micro,chunks", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2),
                                                 (2, 4, 3), (2, 8, 2)])
def test_interleaved_orders_equal_torch_pipelining(stages, micro, chunks):
    _, graph = captured("gpt", n_layer=8, batch_size=8)
    plan = pipeline(graph, stages, micro, "interleaved", chunks=chunks)
    assert actions(plan) == torch_interleaved(stages, micro, chunks)


def test_interleaved_trains_like_one_device():
    w, graph = captured("gpt", n_layer=4)
    plan = pipeline(graph, 2, 4, "interleaved", chunks=2)
    assert {d for op in plan.forward_leaves() for d in [op.device]} == {0, 1}
    trains_like_one_device(w, ct.compile(plan), 3)


def test_several_stages_per_rank_need_an_interleaved_schedule():
    _, graph = captured("gpt", n_layer=4)
    with pytest.raises(ct.PlanError, match="several stages per rank"):
        pipeline(graph, 2, 4, "1f1b", chunks=2)


def write_csv(path, rows: dict[int, list[str]]) -> str:
    path.write_text("".join(",".join(steps) + "\n" for _, steps in sorted(rows.items())))
    return str(path)


def test_torch_schedule_csv_becomes_the_plan_order(tmp_path):
    _, graph = captured("gpt", n_layer=4, batch_size=8)
    want = torch_order("1f1b", 2, 4)
    # torch's CSV keeps idle steps as empty cells and may name gradient reductions
    rows = {r: ["", *steps, f"{r}REDUCE_GRAD"] for r, steps in want.items()}
    schedule, _ = read_schedule(write_csv(tmp_path / "1f1b.csv", rows))
    assert actions(pipeline(graph, 2, 4, schedule)) == want


def test_a_custom_csv_order_trains_like_one_device(tmp_path):
    w, graph = captured("gpt", batch_size=8)
    rows = {0: ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"],  # eager warmup
            1: ["1F0", "1F1", "1B0", "1B1", "1F2", "1F3", "1B2", "1B3"]}  # two at a time
    schedule, _ = read_schedule(write_csv(tmp_path / "mine.csv", rows))
    plan = pipeline(graph, 2, 4, schedule)
    assert actions(plan) == rows
    trains_like_one_device(w, ct.compile(plan), 2)


def test_a_csv_backward_before_its_forward_is_a_named_deadlock(tmp_path):
    _, graph = captured("gpt", n_layer=4, batch_size=8)
    rows = {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1B0", "1F0", "1F1", "1B1"]}
    schedule, _ = read_schedule(write_csv(tmp_path / "bad.csv", rows))
    with pytest.raises(ct.DeadlockError, match="cycle"):
        pipeline(graph, 2, 2, schedule).check()


@pytest.mark.parametrize("rows,match", [
    ({0: ["0F0", "0X"], 1: []}, r"rank 0: cannot read action '0X'"),
    ({0: ["0F0", "0W"], 1: []}, r"cannot read action '0W'"),
])
def test_unreadable_csv_cells_are_named(tmp_path, rows, match):
    with pytest.raises(ct.PlanError, match=match):
        read_schedule(write_csv(tmp_path / "x.csv", rows))


def test_a_csv_that_leaves_out_a_step_is_named(tmp_path):
    _, graph = captured("gpt", n_layer=4, batch_size=8)
    rows = {0: ["0F0", "0F1", "0B0"], 1: ["1F0", "1B0", "1F1", "1B1"]}
    schedule, _ = read_schedule(write_csv(tmp_path / "short.csv", rows))
    with pytest.raises(ct.PlanError, match="pipeline rank 0 .* 0B1 missing"):
        pipeline(graph, 2, 2, schedule)
