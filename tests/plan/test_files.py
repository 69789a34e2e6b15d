"""Plan files: every policy's plan written, read back onto a fresh capture and compiled to
the same code; a file that no longer fits the graph is refused naming the op."""

import json
import warnings

import pytest

import chronotope as ct
from chronotope.cli import main
from chronotope.errors import PlanError
from chronotope.models import get_workload
from chronotope.plan.files import load_plan
from chronotope.policies import POLICIES, ParallelConfig, make, mesh
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference

PIPELINES = {"gpipe", "1f1b", "interleaved", "zb1", "zbv", "chimera", "interlaced"}


def capture(name="gpt", **overrides):
    w = get_workload(name, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


def policy_plan(graph, name: str, devices: int = 4):
    return make(graph, ParallelConfig(
        name, devices, micro=4 if name in PIPELINES else None,
        recompute="selective" if name in ("dp", "tp", "1f1b") else None))


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"csv", "3f1b"}))
def test_every_policys_plan_comes_back_from_its_file_as_the_same_program(policy, tmp_path):
    _, graph = capture()
    plan = policy_plan(graph, policy)
    plan.save(tmp_path / "plan.json")
    _, fresh = capture()
    again = ct.load_plan(fresh, tmp_path / "plan.json")
    first, second = ct.compile(plan), ct.compile(again)
    assert second.ndevices == first.ndevices
    assert all(first.code(r) == second.code(r) for r in range(first.ndevices))


def test_a_loaded_plan_trains_like_one_device(tmp_path):
    w, graph = capture("llama")
    mesh(graph, dp=2, tp=2).save(tmp_path / "plan.json")
    w2, fresh = capture("llama")
    run = run_in_threads(ct.compile(load_plan(fresh, tmp_path / "plan.json")), w2, 2,
                         Optim("sgd", 0.1))
    assert compare(run, train_reference(w2, 2, Optim("sgd", 0.1))).within(1e-5)


def test_a_scaled_plan_and_zero_storage_are_kept(tmp_path):
    _, graph = capture()
    plan = ct.policies.zero(graph, 2, 3).scale(8)
    plan.save(tmp_path / "plan.json")
    again = load_plan(capture()[1], tmp_path / "plan.json")
    assert again.replicas == 8 and again.world_size == 16 and again.param_storage == "owned"
    assert not again.shard_optimizer
    mesh(graph, tp=2).scale(4, shard_optimizer=True).save(tmp_path / "sharded.json")
    assert load_plan(capture()[1], tmp_path / "sharded.json").shard_optimizer
    assert set(again.updates) == set(plan.updates)


def test_a_file_that_no_longer_fits_the_graph_names_the_op(tmp_path):
    _, graph = capture()
    path = tmp_path / "plan.json"
    mesh(graph, tp=2).save(path)
    _, wider = capture(d_model=128)
    with pytest.raises(PlanError, match=r"op 'embedding' is embedding making \(4, 32, 128\) "
                                        r"here; the plan was made for embedding making "
                                        r"\(4, 32, 64\): the model changed"):
        load_plan(wider, path)
    data = json.loads(path.read_text())
    data["ops"]["linear_99"] = {"kind": "linear", "shape": [1], "device": 0}
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="op 'linear_99' \\(linear\\) is not in the graph of gpt"):
        load_plan(graph, path)
    with pytest.raises(PlanError, match="op 'arange' \\(factory\\) is not in the graph of llama"):
        load_plan(capture("llama")[1], path)
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(PlanError, match="version 99; this chronotope reads version 1"):
        load_plan(graph, path)
    path.write_text("{not json")
    with pytest.raises(PlanError, match="cannot read plan file"):
        load_plan(graph, path)


def test_the_command_line_writes_and_reads_plan_files(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--policy", "1f1b", "--devices", "2", "--save-plan",
                 str(path)]) == 0
    assert json.loads(path.read_text())["devices"] == 2
    capsys.readouterr()
    assert main(["run", "gpt", "--plan", str(path), "--steps", "2", "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["devices"] == 2 and report["match"]
    assert main(["simulate", "gpt", "--plan", str(path), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ranks"]) == 2
    path.write_text(path.read_text().replace('"embedding"', '"embedding_9"', 1))
    assert main(["plan", "gpt", "--plan", str(path)]) == 2
    assert "op 'embedding_9'" in capsys.readouterr().err
