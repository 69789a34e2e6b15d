"""Timelines: the schedule's shape, its bubble, the files."""

import json
import warnings

import pytest

import chronotope as ct
from chronotope.cli import main
from chronotope.cost import piece_seconds
from chronotope.measure import measure_ops
from chronotope.models import get_workload
from chronotope.policies import pipeline, timeline
from chronotope.viz import save_timeline


@pytest.fixture(scope="module")
def graph():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(get_workload("gpt", n_layer=8, batch_size=8))


def equal_steps(rank: int, step: str) -> float:
    return 2.0 if "B" in step else 1.0  # a backward costs two forwards


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 8)])
def test_equal_steps_give_the_textbook_bubble(graph, schedule, stages, micro):
    drawn = timeline(pipeline(graph, stages, micro, schedule), step_cost=equal_steps)
    assert drawn.makespan == pytest.approx(3 * (micro + stages - 1))
    assert drawn.bubble_ratio == pytest.approx((stages - 1) / (micro + stages - 1))


def test_interleaving_shrinks_the_bubble(graph):
    plain = timeline(pipeline(graph, 4, 8, "1f1b"), step_cost=equal_steps)
    interleaved = timeline(pipeline(graph, 4, 8, "interleaved", chunks=2),
                           step_cost=lambda r, s: equal_steps(r, s) / 2)  # half-size stages
    assert interleaved.bubble_ratio < plain.bubble_ratio


def test_each_rank_runs_its_steps_in_plan_order_without_overlap(graph):
    drawn = timeline(pipeline(graph, 4, 8, "1f1b"))
    for rank in drawn.ranks:
        bars = [b for b in drawn.bars if b.rank == rank]
        assert all(a.end <= b.start + 1e-15 for a, b in zip(bars, bars[1:]))
    first_backward = min(b.start for b in drawn.bars if b.step == "0B0")
    assert first_backward >= max(b.end for b in drawn.bars if b.step == "3B0")


def test_png_and_html_files(graph, tmp_path):
    drawn = timeline(pipeline(graph, 2, 4, "1f1b"))
    save_timeline(drawn, str(tmp_path / "t.png"), "gpt")
    save_timeline(drawn, str(tmp_path / "t.html"), "gpt")
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")
    page = (tmp_path / "t.html").read_text()
    assert "<svg" in page and "bubble" in page and "1B0" in page
    with pytest.raises(ct.PlanError, match="png or .html"):
        save_timeline(drawn, str(tmp_path / "t.txt"))


def test_timeline_command(capsys, tmp_path):
    out = tmp_path / "t.png"
    assert main(["timeline", "gpt", "--policy", "1f1b", "--devices", "2", "--batch-size", "4",
                 "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert 0 < report["bubble_ratio"] < 1 and out.exists()
    assert main(["timeline", "gpt", "--policy", "dp", "--devices", "2",
                 "--out", str(out)]) == 2
    assert "no pipeline steps" in capsys.readouterr().err


def test_measured_op_times_give_the_pieces_their_share():
    w = get_workload("gpt", n_layer=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = ct.capture(w)
    times = measure_ops(g, w, repeats=1)
    assert set(times) == {op.name for op in g}
    assert all(t.forward >= 0 and t.backward >= 0 for t in times.values())
    linear = next(op for op in g if op.kind == "linear")
    assert times[linear.name].forward > 0 and times[linear.name].backward > 0
    plan = pipeline(g, 2, 4, "1f1b")
    pieces = [p for p in plan.leaves(linear.name)]  # one per micro-batch
    assert sum(piece_seconds(p, times) for p in pieces) == pytest.approx(
        times[linear.name].forward)
    drawn = timeline(plan, measured=times)
    assert 0 < drawn.bubble_ratio < 1


def test_timeline_command_measures(capsys, tmp_path):
    out = tmp_path / "t.html"
    assert main(["timeline", "gpt", "--policy", "zb1", "--devices", "2", "--out", str(out),
                 "--measure", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured"] and 0 < report["bubble_ratio"] < 1 and "W" in out.read_text()


def test_messages_between_ranks_take_link_time(graph):
    plan = pipeline(graph, 2, 4, "1f1b")
    free = timeline(plan, step_cost=equal_steps)
    slow = timeline(plan, step_cost=equal_steps, bytes_per_s=1e6)
    messages = [b for b in slow.bars if b.message]
    assert not any(b.message for b in free.bars) and messages
    assert {b.kind for b in messages} == {"C"} and slow.makespan > free.makespan
    residual = graph.inputs[0].shape[0] // 4 * 32 * 64 * 4  # a micro-batch's, in bytes
    assert all(b.end - b.start >= residual / 1e6 * 0.999 for b in messages)
