"""The auto-tuner: a schedule's knobs span a space (ranges that depend on earlier knobs
included), every point is priced by the simulator, and the fastest one that fits wins."""

import json
import warnings

import pytest

import chronotope as ct
from chronotope.cli import main
from chronotope.models import get_workload
from chronotope.schedule import apply
from chronotope.schedule.tune import space


@pytest.fixture(scope="module")
def gpt8():
    workload = get_workload("gpt", batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return workload, ct.capture(workload)


@pytest.fixture
def tunable(gpt8, gallery):
    return gallery("gpt_tune.py:tunable"), *gpt8


def test_the_space_follows_ranges_that_depend_on_earlier_knobs(tunable):
    fn, workload, graph = tunable
    points = space(fn, workload, 4, graph)
    assert len(points) == 60 and len({tuple(p.items()) for p in points}) == 60
    assert all(p["tp"] * p["pp"] <= 4 for p in points)
    assert all(p["micro"] in ((1, 2) if p["pp"] == 1 else (2, 4)) for p in points)


def test_coordinate_descent_finds_the_exhaustive_best_pricing_fewer_points(tunable):
    fn, workload, graph = tunable
    whole = ct.tune(fn, workload, 4, graph=graph, method="exhaustive")
    assert whole.method == "exhaustive" and len(whole.points) == whole.space == 60
    fastest = min(p.step_time for p in whole.points if p.fits)
    assert whole.best.step_time == fastest
    descent = ct.tune(fn, workload, 4, graph=graph)  # auto: 60 points is past exhaustive
    assert descent.method == "coordinate descent" and len(descent.points) < 60
    assert descent.best.knobs == whole.best.knobs
    # the point found is a schedule like any other: it trains like one device
    sch = apply(fn, ct.schedule(workload, devices=4, graph=graph, knobs=descent.best.knobs))
    assert sch.verify(steps=1).within(1e-5)


def test_points_that_need_more_memory_than_the_devices_have_are_never_chosen(tunable):
    _, workload, graph = tunable

    def small(sch):
        pp = sch.knob("pp", [1, 2, 4])
        for stage in range(1, pp):
            sch[f"h.{4 * stage // pp - 1}"].cut_pipeline_stage()
        sch.replicate(4 // pp).micro_batches(2)
        if sch.knob("checkpoint", [False, True]):
            for i in range(4):
                sch[f"h.{i}"].checkpoint()

    free = ct.tune(small, workload, 4, graph=graph)
    limit = sorted(p.memory for p in free.points)[2] + 1  # the three smallest fit
    tight = ct.tune(small, workload, 4, memory=limit, graph=graph)
    assert sum(p.fits for p in tight.points) == 3
    assert tight.best.memory <= limit and tight.best.step_time >= free.best.step_time
    assert all("more than" in p.refused for p in tight.points if not p.fits)


def test_knobs_are_checked(tunable):
    fn, workload, graph = tunable
    with pytest.raises(ct.ScheduleError, match=r"sch.knob\('tp'\) = 3: choose one of 1, 2, 4"):
        apply(fn, ct.schedule(workload, devices=4, graph=graph, knobs={"tp": 3}))
    with pytest.raises(ct.ScheduleError, match="knob 'tpp' is not one the schedule asks for"):
        apply(fn, ct.schedule(workload, devices=4, graph=graph, knobs={"tpp": 2}))
    sch = ct.schedule(workload, devices=4, graph=graph)
    sch.knob("a", [1])
    with pytest.raises(ct.ScheduleError, match="declared twice"):
        sch.knob("a", [2])


def test_cli_tune_prices_a_space_measures_the_best_and_says_how_to_run_it(capsys, tmp_path):
    spec = tmp_path / "knobs.py"
    spec.write_text(
        "def fn(sch):\n"
        "    if sch.knob('dp', [1, 2]) > 1:\n"
        "        sch.replicate(2)\n"
        "    if sch.knob('ckpt', [False, True]):\n"
        "        sch['h.0'].checkpoint()\n")
    assert main(["tune", "gpt", "--schedule", f"{spec}:fn", "--devices", "2", "--measure",
                 "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["method"] == "exhaustive" and report["space"] == report["priced"] == 4
    measured = [p for p in report["points"] if p["measured"] is not None]
    assert len(measured) == 1 and measured[0]["knobs"] == report["best"]["knobs"]
    assert main(["tune", "gpt", "--schedule", f"{spec}:fn", "--devices", "2"]) == 0
    assert "--knob dp=" in capsys.readouterr().out
