"""Search constraints: each kind is kept to by the plan found, a set nothing satisfies is
refused naming its fewest conflicting constraints and the shortfall, and the candidates
say which constraints bound them."""

import json

import pytest

import chronotope as ct
from chronotope.cli import main
from chronotope.graph.capture import capture
from chronotope.models import get_workload
from chronotope.plan.steps import Step
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference
from chronotope.search import Constraints, SearchError, explain, search
from chronotope.search.constraints import ConstraintError, Cut, Knob


@pytest.fixture(scope="module")
def gpt():
    return capture(get_workload("gpt", batch_size=8))


def test_a_toml_file_and_a_mapping_give_the_same_typed_constraints(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('tp = 2\npp = [1, 2]\nmicro = {min = 2, max = 8}\nschedule = "zb1"\n'
                    'recompute = ["none", "full"]\nswap = false\nzero = "zero1"\n'
                    '"lm_head" = "replicate"\n[cuts]\n"kind:embedding" = "split b*"\n')
    loaded = Constraints.load(path)
    assert loaded == Constraints.parse({
        "tp": 2, "pp": [1, 2], "micro": {"min": 2, "max": 8}, "schedule": "zb1",
        "recompute": ["none", "full"], "swap": False, "zero": "zero1",
        "lm_head": "replicate", "cuts": {"kind:embedding": "split b*"}})
    assert loaded.names == ["tp = 2", "pp in 1, 2", "micro in 2..8", "schedule = zb1",
                            "recompute in none, full", "swap = false", "zero = zero1",
                            "lm_head = replicate", "kind:embedding = split b*"]
    assert loaded.cuts == {"lm_head": "replicate", "kind:embedding": "split b*"}
    assert Knob("micro", low=4).name == "micro >= 4" and Cut("h.*", "replicate") in \
        Constraints.parse({"h.*": "replicate"})


@pytest.mark.parametrize("text, message", [
    ("tpp = 3", "unknown constraint 'tpp'"),
    ("tp = 0", "a degree is a positive whole number"),
    ("pp = {min = 4, max = 2}", "bounds are"),
    ('schedule = "gpipe"', "schedule = 'gpipe': use one of none, 1f1b, zb1, interleaved"),
    ("swap = 1", "swap = 1: use one of false, true"),
    ("tp = [", "is not TOML"),
])
def test_a_constraint_that_does_not_parse_is_named_with_its_file(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConstraintError, match=message) as e:
        Constraints.load(path)
    assert "bad.toml" in str(e.value)
    with pytest.raises(ConstraintError, match="cannot read the constraints file"):
        Constraints.load(tmp_path / "missing.toml")


@pytest.mark.parametrize("constraints, kept", [
    ({"tp": 2}, lambda r: " tp 2 " in r.mesh and "split" in " ".join(r.choices.values())),
    ({"dp": 2}, lambda r: r.mesh.startswith("dp 2 ")),
    ({"pp": 2, "micro": 4}, lambda r: len(explain(r)["stages"]) == 2 and r.plan.micro == 4),
    ({"chunks": 2}, lambda r: len(explain(r)["stages"]) == 2 * int(r.mesh.split("pp ")[1][0])),
    ({"schedule": "zb1"}, lambda r: "zero bubble" in r.mesh),
    ({"schedule": "1f1b", "pp": 2}, lambda r: "zero bubble" not in r.mesh and
     "stages per rank" not in r.mesh),
    ({"recompute": "full"}, lambda r: r.plan.recomputed and not r.plan.swapped),
    ({"swap": True}, lambda r: r.plan.swapped),
    ({"sequence": True}, lambda r: "sequence parallel" in r.mesh),
    ({"zero": "zero3"}, lambda r: r.plan.param_storage == "owned"),
    ({"micro": {"min": 4}}, lambda r: r.plan.micro >= 4),
    ({"coshard": 2}, lambda r: "co-shard 2" in r.mesh and r.plan.recomputed),
])
def test_the_plan_found_keeps_to_each_knob_constraint(gpt, constraints, kept):
    result = search(gpt, 4, constraints=constraints, simulate=False)
    assert result.method == "mesh" and kept(result), result.mesh


def test_cuts_by_kind_and_the_ilp_stages_and_micro_batches_are_kept(gpt):
    result = search(gpt, 4, constraints={"kind:embedding": "replicate"}, simulate=False)
    embeddings = [op.name for op in gpt.ops if op.kind == "embedding"]
    assert result.method == "ilp" and embeddings
    assert all(result.choices[name] == "replicate" for name in embeddings)
    result = search(gpt, 4, method="ilp", constraints={"pp": 2, "micro": 4}, simulate=False)
    assert result.mesh.startswith("2 stages x ")
    assert len({micro for _, _, micro in result.plan.cells}) == 4
    with pytest.raises(SearchError, match="method='ilp' cannot keep to tp = 2: tp = 2: "
                                          "method='mesh'"):
        search(gpt, 4, method="ilp", constraints={"tp": 2})


def test_constraints_no_family_keeps_together_name_which_keeps_each(gpt):
    with pytest.raises(SearchError, match="no family of the search keeps to all the "
                                          "constraints: tp = 2: method='mesh'; lm_head = "
                                          "replicate: method='ilp'"):
        search(gpt, 4, constraints={"tp": 2, "lm_head": "replicate"})


def test_a_degree_the_devices_do_not_divide_names_the_values_there_are(gpt):
    with pytest.raises(SearchError, match=r"no plan keeps to tp = 3: over 4 devices tp can "
                                          r"be 1, 2, 4 \("):
        search(gpt, 4, constraints={"tp": 3})


def test_an_infeasible_set_is_cut_to_its_fewest_conflicting_constraints(gpt):
    """``recompute`` and ``swap`` take no part in the conflict of tp and pp: the error
    names only the two, each with what the other allows."""
    with pytest.raises(SearchError) as e:
        search(gpt, 4, constraints={"recompute": ["none", "full"], "tp": 4, "pp": 4,
                                    "swap": False})
    assert str(e.value).startswith("no plan keeps to tp = 4; pp = 4 together: over 4 "
                                   "devices tp can be 1 with pp = 4; pp can be 1 with tp = 4")


def test_a_memory_conflict_names_the_memory_and_the_shortfall(gpt):
    with pytest.raises(SearchError) as e:
        search(gpt, 4, memory=2e6, constraints={"sequence": False, "tp": 1, "pp": 1})
    text = str(e.value)  # sequence parallelism needs tp > 1: no part of the conflict
    assert text.startswith("no plan keeps to tp = 1; pp = 1; memory <= 1.9 MiB per device "
                           "together: the least a plan of tp = 1; pp = 1 needs is about ")
    assert " over; " in text and "sequence" not in text
    search(gpt, 4, memory=2e6, constraints={"sequence": False}, simulate=False)  # fits
    with pytest.raises(SearchError, match=r"no plan keeps to memory <= 976.6 KiB per device: "
                                          r".* the least any needs is about .* over\)"):
        search(gpt, 4, memory=1e6, method="ilp", constraints={"pp": [1, 2]}, simulate=False)


def test_the_candidates_say_which_constraints_bound_them_and_which_ready_made_break(gpt):
    result = search(gpt, 4, constraints={"tp": 2, "pp": {"max": 4}})
    found, *ready = result.candidates
    assert found["binding"] == ["tp = 2"]  # dp 4 is cheaper; no plan needs more stages
    assert {c["plan"]: c["violates"] for c in ready} == {"dp": ["tp = 2"], "tp": ["tp = 2"]}
    loose = search(gpt, 4, constraints={"tp": [1, 2, 4]}, simulate=False)
    assert loose.candidates[0]["binding"] == []
    assert loose.predicted_step_s == search(gpt, 4, simulate=False).predicted_step_s


def test_the_cli_reads_a_constraints_file_and_shows_what_binds(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text("tp = 2\n")
    assert main(["search", "gpt", "--devices", "4", "--batch-size", "8", "--constraints",
                 str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["candidates"][0]["binding"] == ["tp = 2"] and " tp 2 " in out["mesh"]
    assert main(["search", "gpt", "--devices", "4", "--batch-size", "8", "--constraints",
                 str(path)]) == 0
    assert "binding: tp = 2" in capsys.readouterr().out
    path.write_text("tp = 3\n")
    assert main(["search", "gpt", "--devices", "4", "--constraints", str(path)]) != 0
    assert "no plan keeps to tp = 3" in capsys.readouterr().err


def test_a_3f1b_schedule_is_searched_for_a_model_that_recycles_and_trains_like_one_device():
    """The Evoformer runs itself four times a step, the first three without gradients:
    held to 3F1B, the search puts a stage of every pass on each pipeline rank and runs
    the backward of the last pass alone; a model that runs once has no 3F1B point."""
    w = get_workload("evoformer", batch_size=8)
    found = search(capture(w), 4, method="mesh", constraints={"schedule": "3f1b"})
    assert "3F1B over 4 passes" in found.mesh and found.candidates[0]["binding"] == [
        "schedule = 3f1b"]
    steps = [s for row in ct.policies.actions(found.plan).values() for a in row
             if (s := Step.parse(a)) is not None]
    pp = 1 + max(s.stage for s in steps) // 4
    assert pp > 1 and {s.stage // pp for s in steps if s.kind.name == "B"} == {3}
    run = run_in_threads(ct.compile(found.plan), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)
    with pytest.raises(SearchError, match="schedule = 3f1b"):
        search(capture(get_workload("gpt", batch_size=8)), 4, method="mesh",
               constraints={"schedule": "3f1b"})
