"""The ``chronotope`` command line, called as users call it."""

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from chronotope import cli
from chronotope.cli import main
from chronotope.models import get_workload
from chronotope.runtime.reference import train_reference


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_capture_builtin_json(capsys):
    report = run_json(capsys, "capture", "gpt")
    assert report["model"] == "gpt"
    assert report["num_ops"] > 50 and report["num_params"] == 234_880
    assert report["unannotated_ops"] == []


def test_capture_prints_a_summary(capsys):
    assert main(["capture", "llama", "--print-graph"]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "parameters" in out and "= linear(" in out


def test_capture_user_model_file(tmp_path, capsys):
    path = tmp_path / "mymodel.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 1)

            def forward(self, x):
                return torch.special.erfcx(self.b(torch.tanh(self.a(x)))).mean()

        def make():
            return Net(), torch.randn(3, 6)
    """))
    report = run_json(capsys, "capture", f"{path}:make")
    assert report["num_params"] == 6 * 5 + 5 + 5 + 1
    (missing,) = report["unannotated_ops"]
    assert missing["kind"] == "special_erfcx" and "mymodel.py:11" in missing["source"]


def test_unknown_model_lists_the_builtins(capsys):
    assert main(["capture", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "gpt" in err and "llama" in err
    assert "Traceback" not in err


def test_console_entry_point_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "chronotope.cli", "capture", "bert", "--json"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["unannotated_ops"] == []
    bad = subprocess.run([sys.executable, "-m", "chronotope.cli", "capture", "missing.py:make"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "missing.py" in bad.stderr and "Traceback" not in bad.stderr


def test_plan_writes_code_and_reports_per_rank(tmp_path, capsys):
    report = run_json(capsys, "plan", "gpt", "--devices", "2", "--out", str(tmp_path))
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert report["ranks"][0]["received_bytes"]["all_reduce"] > 0  # the gradients' sum
    assert (tmp_path / "rank0.py").exists() and (tmp_path / "launch.py").exists()


def test_plan_with_compile_writes_forward_regions_for_torch_compile(tmp_path, capsys):
    run_json(capsys, "plan", "gpt", "--devices", "2", "--out", str(tmp_path),
             "--compile", "aot_eager")
    code = (tmp_path / "rank0.py").read_text()
    assert "\ndef forward_0(" in code and "= forward_0(" in code
    specs = torch.load(tmp_path / "program.pt", weights_only=False)["specs"]
    assert {spec.compile for spec in specs} == {"aot_eager"}  # what torchrun's ranks run
    assert main(["run", "gpt", "--devices", "2", "--compile", "nope"]) == 2
    assert "torch.compile has no backend 'nope'" in capsys.readouterr().err


def test_plan_that_does_not_divide_exits_2(capsys):
    assert main(["plan", "gpt", "--devices", "3"]) == 2
    assert "divisible by 3" in capsys.readouterr().err


@pytest.mark.slow
def test_run_check_matches_one_device(capsys):
    report = run_json(capsys, "run", "gpt", "--devices", "2", "--steps", "2", "--check")
    assert report["policy"] == "dp" and report["devices"] == 2 and len(report["losses"]) == 2
    assert report["max_loss_rel_diff"] <= 1e-5 and report["max_param_rel_diff"] <= 1e-5
    assert report["step_time_s"] > 0


def test_run_replicas_scales_a_plan_and_matches_one_device_on_the_whole_batch(capsys):
    report = run_json(capsys, "run", "gpt", "--policy", "tp", "--devices", "2", "--replicas",
                      "2", "--steps", "2", "--check")
    assert report["replicas"] == 2 and report["match"], report
    assert main(["plan", "gpt", "--devices", "2", "--replicas", "3"]) == 2
    assert "does not split into 3 replicas" in capsys.readouterr().err


def test_run_fold_compiles_one_micro_batch_and_matches_one_device(capsys):
    report = run_json(capsys, "run", "gpt", "--policy", "1f1b", "--devices", "2", "--micro",
                      "4", "--fold", "--steps", "2", "--check")
    assert report["match"], report
    assert main(["plan", "gpt", "--policy", "chimera", "--devices", "2", "--fold"]) == 2
    assert "fold runs one pipeline" in capsys.readouterr().err


def test_run_takes_a_module_schedule_file_and_reports_what_it_cannot_apply(capsys, tmp_path):
    gallery = Path(__file__).parents[1] / "docs" / "schedules"
    report = run_json(capsys, "run", "gpt", "--schedule", f"{gallery}/gpt_megatron.py:megatron",
                      "--devices", "2", "--steps", "1", "--check")
    assert report["policy"] == "schedule gpt_megatron.py:megatron" and report["match"], report
    bad = tmp_path / "bad.py"
    bad.write_text("def half(sch):\n    sch['h.0.mlp.c_proj'].shard('weight', axis=1)\n")
    assert main(["plan", "gpt", "--schedule", f"{bad}:half", "--devices", "2"]) == 2
    assert "add sch['h.0.mlp.c_proj'].sync(mode='fwd_post', op='all_reduce')" in \
        capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("model, policy, devices", [
    ("gpt", "tp", 4), ("llama", "sp", 2), ("bert", "dp-tp", 4), ("gpt", "dp-sp", 4),
    ("gpt", "zero-1", 2), ("llama", "zero-2", 4), ("bert", "zero-3", 2),
    ("gpt", "1f1b", 4), ("llama", "gpipe --micro 2", 2), ("bert", "1f1b --pp 2", 4),
    ("gpt", "interleaved --chunks 2", 2), ("llama", "1f1b --recompute full", 2),
    ("gpt", "dp --recompute selective", 2), ("gpt", "1f1b --swap full", 2),
    ("gpt", "zb1", 2), ("llama", "zbv", 2), ("gpt", "coshard --tp 2 --coshard 2", 2),
    ("gpt", "chimera", 4), ("evoformer", "3f1b", 2), ("t5", "interlaced", 2),
])
def test_every_policy_trains_like_one_device_on_gloo(capsys, model, policy, devices):
    policy, *options = policy.split()
    report = run_json(capsys, "run", model, "--policy", policy, "--devices", str(devices),
                      "--steps", "3", "--check", *options)
    assert report["policy"] == policy and len(report["losses"]) == 3
    assert report["max_loss_rel_diff"] <= 1e-5 and report["max_param_rel_diff"] <= 1e-5


def test_a_mesh_that_does_not_factor_exits_2(capsys):
    assert main(["plan", "gpt", "--policy", "dp-tp", "--devices", "6", "--tp", "4"]) == 2
    assert "--tp 4 x --pp 1 does not divide --devices 6" in capsys.readouterr().err


@pytest.mark.slow
def test_a_csv_schedule_trains_like_one_device_on_gloo(capsys, tmp_path):
    csv = tmp_path / "mine.csv"
    csv.write_text("0F0,0F1,0F2,0B0,0F3,0B1,0B2,0B3\n1F0,1F1,1B0,1B1,1F2,1F3,1B2,1B3\n")
    report = run_json(capsys, "run", "gpt", "--policy", "csv", "--schedule", str(csv),
                      "--devices", "2", "--batch-size", "8", "--steps", "2", "--check")
    assert report["max_loss_rel_diff"] <= 1e-5 and report["max_param_rel_diff"] <= 1e-5


def test_recompute_with_zero_exits_2(capsys):
    assert main(["plan", "gpt", "--policy", "zero-2", "--devices", "2", "--recompute",
                 "full"]) == 2
    assert "policy zero-2 does not read --recompute full (it reads --tp)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("policy,options,unread", [
    ("tp", ["--tp", "4", "--coshard", "7", "--chunks", "5"], "--tp 4, --chunks 5, --coshard 7"),
    ("dp", ["--micro", "4", "--fold"], "--micro 4, --fold"),
    ("1f1b", ["--chunks", "2"], "--chunks 2"),
    ("interlaced", ["--swap", "full"], "--swap full"),
])
def test_options_a_policy_does_not_read_exit_2_naming_them(capsys, policy, options, unread):
    assert main(["plan", "gpt", "--policy", policy, "--devices", "2", *options]) == 2
    assert f"policy {policy} does not read {unread} (it reads" in capsys.readouterr().err


def test_csv_policy_without_a_file_exits_2(capsys):
    assert main(["plan", "gpt", "--policy", "csv", "--devices", "2"]) == 2
    assert "csv needs --schedule FILE.csv" in capsys.readouterr().err


def test_a_pipeline_that_does_not_divide_the_devices_exits_2(capsys):
    assert main(["plan", "gpt", "--policy", "1f1b", "--devices", "4", "--pp", "3"]) == 2
    assert "--pp 3 stages do not divide --devices 4" in capsys.readouterr().err


def test_plan_of_a_large_preset_needs_no_weights(capsys):
    report = run_json(capsys, "plan", "gpt3-1.3b", "--devices", "2")
    memory = report["ranks"][0]["memory_bytes"]
    model = get_workload("gpt3-1.3b", device="meta").model
    assert memory["params"] == 4 * sum(p.numel() for p in model.parameters())  # all, float32
    assert main(["plan", "gpt3-1.3b", "--devices", "2", "--out", "x"]) == 2


def test_bench_rvd_prices_the_papers_18_cases(capsys):
    cases = run_json(capsys, "bench", "rvd")
    inter = [c for c in cases if "->" in c["case"]]
    assert len(inter) == 18 and set(cases[0]) == {"case", "p2p_s", "rvd_s", "speedup", "path"}
    assert all(c["rvd_s"] <= c["p2p_s"] * (1 + 1e-9) for c in inter)
    assert sum(c["speedup"] > 1.001 for c in inter) == 12  # the paper's 12 of 18
    by_case = {c["case"]: c for c in inter}
    assert by_case["R(1)V(8)D(1)->R(8)V(1)D(1)"]["path"].startswith("reduce-scatter")


def test_bench_rvd_needs_two_nodes(capsys):
    assert main(["bench", "rvd", "--cluster", "dgx-a100"]) == 2
    assert "dgx-a100x2" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_writes_a_file_bench_accepts(capsys, tmp_path):
    out = tmp_path / "cluster.json"
    report = run_json(capsys, "profile", "--devices", "2", "--repeats", "2", "--out", str(out))
    assert report["per_node"] == 2 and out.exists()
    assert main(["bench", "rvd", "--cluster", str(out)]) == 2  # one node of two devices
    assert "two nodes" in capsys.readouterr().err


def test_simulate_predicts_each_device_on_a_preset(capsys):
    report = run_json(capsys, "simulate", "gpt", "--policy", "1f1b", "--devices", "4",
                      "--micro", "4", "--cluster", "h100-sxm")
    assert report["cluster"] == "h100-sxmx1" and len(report["ranks"]) == 4
    assert 0 < report["bubble_ratio"] < 1 and report["step_time_s"] > 0
    assert all(r["peak_memory"] > 0 for r in report["ranks"])


def test_simulate_measured_here(capsys):
    report = run_json(capsys, "simulate", "gpt", "--policy", "dp", "--devices", "2",
                      "--measure")
    assert report["step_time_s"] > 0


CHATTY = """
import os

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 4)

    def forward(self, x):
        print("forward says hello")
        return self.a(x).square().mean()


def make():
    print("factory says hello")
    os.write(1, b"and so does native code\\n")
    return Net(), torch.randn(4, 6)
"""


@pytest.mark.parametrize("command", [["capture"], ["plan", "--devices", "2"],
                                     ["simulate", "--devices", "2"]])
def test_a_model_that_prints_leaves_stdout_to_the_json(tmp_path, capfd, command):
    path = tmp_path / "chatty.py"
    path.write_text(CHATTY)
    assert main([command[0], f"{path}:make", *command[1:], "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)
    assert "factory says hello" in err and "forward says hello" in err
    assert "and so does native code" in err


@pytest.mark.slow
def test_a_model_that_prints_leaves_stdout_to_the_json_of_run(tmp_path):
    path = tmp_path / "chatty.py"
    path.write_text(CHATTY)
    done = subprocess.run([sys.executable, "-m", "chronotope.cli", "run", f"{path}:make",
                           "--devices", "2", "--steps", "1", "--check", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["match"] is True
    assert "factory says hello" in done.stderr


def _diverging(how):
    """A stand-in for the processes' run: the single-device run, spoiled as ``how`` says."""
    def run(program, workload, steps, optim, timeout, precision=None, backend="gloo",
            compile=None):
        result = train_reference(workload, steps, optim)
        if how == "nan-loss":
            result.losses[-1] = math.nan
        elif how == "no-losses":
            result.losses.clear()
        else:
            name = sorted(result.params)[-1]
            result.params[name].view(-1)[-1] = math.nan
        return result
    return run


@pytest.mark.parametrize("how", ["nan-loss", "no-losses", "nan-param"])
@pytest.mark.parametrize("as_json", [True, False])
def test_run_check_exits_1_on_any_mismatch(capsys, monkeypatch, how, as_json):
    monkeypatch.setattr(cli, "run_processes", _diverging(how))
    argv = ["run", "gpt", "--devices", "2", "--steps", "2", "--check"]
    assert main(argv + ["--json"] * as_json) == 1
    out = capsys.readouterr().out
    if as_json:
        assert json.loads(out)["match"] is False
    else:
        assert "MISMATCH" in out


NOISY = '''
import torch
import torch.nn.functional as F
from torch import nn


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.alpha_dropout(self.fc(x), 0.5, True).pow(2).mean()


def make():
    return Noisy(), torch.randn(4, 4)
'''


@pytest.mark.parametrize("as_json", [True, False])
def test_run_check_names_random_ops_left_on_torchs_generator(capsys, monkeypatch, tmp_path,
                                                              as_json):
    (tmp_path / "noisy.py").write_text(NOISY)
    monkeypatch.setattr(cli, "run_processes", _diverging("nan-loss"))
    argv = ["run", f"{tmp_path / 'noisy.py'}:make", "--devices", "2", "--steps", "1", "--check"]
    assert main(argv + ["--json"] * as_json) == 1
    out = capsys.readouterr().out
    if as_json:
        graph_op, in_model = json.loads(out)["torch_random_ops"]
        assert graph_op.startswith("alpha_dropout") and "noisy.py" in graph_op
        assert in_model == "alpha_dropout (in the model, one device)"
    else:
        assert "draw from torch's generator" in out and "alpha_dropout" in out


def test_a_config_file_gives_every_option_and_the_command_line_overrides_it(tmp_path, capsys):
    from chronotope.cli import _with_config

    config = tmp_path / "run.toml"
    config.write_text('model = "llama"\npolicy = "tp"\ndevices = 4\nsteps = 7\n'
                      '[optimizer]\noptimizer = "adamw"\nlr = 1e-3\n'
                      'optimizer-args = {betas = [0.8, 0.9]}\nlr_schedule = "StepLR"\n'
                      '[checkpoints]\nsave = "ck"\nskip-nonfinite = true\n')
    argv = ["train", "--config", str(config), "--devices", "2"]
    args = _with_config(argv, "train", str(config))
    assert (args.model, args.policy, args.devices, args.steps) == ("llama", "tp", 2, 7)
    assert (args.optimizer, args.lr, args.optimizer_args) == ("adamw", 1e-3,
                                                             {"betas": [0.8, 0.9]})
    assert (args.lr_schedule, args.save, args.skip_nonfinite) == ("StepLR", "ck", True)
    report = run_json(capsys, "plan", "--config", str(config), "--devices", "2")
    assert report["model"] == "llama" and report["policy"] == "tp" and report["devices"] == 2
    for text, why in (("stepz = 3", "stepz is no option of chronotope"),
                      ("steps = -3", "steps: expected a whole number of at least 1"),
                      ("[x]\npolicy = 'nope'", "x.policy: 'nope' is not one of dp"),
                      ("skip-nonfinite = 1", "expected true or false"),
                      ("steps = [", "cannot read it as TOML")):
        config.write_text(text + "\n")
        assert main(["train", "--config", str(config)]) == 2
        assert why in capsys.readouterr().err, text


@pytest.mark.slow
def test_plan_writes_a_pipelines_actions_that_run_back_as_a_csv_schedule(tmp_path, capsys):
    path = tmp_path / "zb1.csv"
    run_json(capsys, "plan", "gpt", "--policy", "zb1", "--devices", "2", "--micro", "4",
             "--actions", str(path))
    rows = path.read_text().splitlines()
    assert len(rows) == 2 and rows[0].startswith("0F0,0F1") and "1W3" in rows[1]
    report = run_json(capsys, "run", "gpt", "--policy", "csv", "--schedule", str(path),
                      "--devices", "2", "--steps", "1", "--check")
    assert report["match"], report
    assert main(["plan", "gpt", "--devices", "2", "--actions", str(tmp_path / "dp.csv")]) == 2
    assert "has no pipeline steps" in capsys.readouterr().err
