"""Every command's arguments, bad value by bad value: each is refused with exit code 2
and a one-line reason on stderr that names the option, never a traceback."""

import json
import shlex

import pytest
import torch

from chronotope.cli import main

MODEL_COMMANDS = ("plan", "run", "simulate", "timeline")


def _for_model_commands() -> list[tuple[str, str]]:
    """Bad values of the options plan, run, simulate and timeline share."""
    cases = [
        ("--devices 0", "--devices"), ("--devices -1", "--devices"), ("--devices two", "--devices"),
        ("--devices 3", "--devices 3"),  # gpt's batch of 4 does not split 3 ways
        ("--tp 0", "--tp"), ("--pp 0", "--pp"), ("--micro 0", "--micro"),
        ("--chunks 0", "--chunks"), ("--coshard -2", "--coshard"),
        ("--batch-size 0", "--batch-size"), ("--batch-size 1.5", "--batch-size"),
        ("--policy nope", "--policy"), ("--recompute most", "--recompute"),
        ("--swap all", "--swap"),
        ("--policy dp-tp --devices 6 --tp 4", "--tp 4"),
        ("--policy 1f1b --devices 4 --pp 3", "--pp 3"),
        ("--policy zero-2 --devices 2 --recompute full", "--recompute"),
        ("--policy csv --devices 2", "--schedule"),
        ("--policy csv --devices 2 --schedule {tmp}/missing.csv", "--schedule"),
        ("--policy csv --devices 2 --schedule {tmp}/garbage.csv", "garbage.csv"),
        ("--policy 1f1b --devices 2 --schedule {tmp}/garbage.csv", "--schedule"),
        ("--no-such-option", "--no-such-option"),
    ]
    return [(f"{cmd} gpt {argv}" + (" --out {tmp}/t.png" if cmd == "timeline" else ""), why)
            for cmd in MODEL_COMMANDS for argv, why in cases]


BAD = [
    ("capture", "model"),
    ("capture gpt --batch-size -2", "--batch-size"),
    ("capture gpt --device gpu", "--device"), ("capture gpt --device mps", "--device"),
    ("capture gpt --frontend jit", "--frontend"),
    ("capture no-such-model", "no-such-model"),
    ("capture {tmp}/missing.py:make", "missing.py"),
    ("capture {tmp}/garbage.csv", "garbage.csv"),
    *_for_model_commands(),
    *[(f"{cmd} gpt {argv}", why) for cmd in ("plan", "run", "simulate")
      for argv, why in [("--comm mpi", "--comm"), ("--cluster nope", "--cluster"),
                        ("--cluster {tmp}/missing.json", "--cluster"),
                        ("--cluster {tmp}/garbage.csv", "--cluster")]],
    ("plan gpt --devices 2 --out {tmp}/garbage.csv", "--out"),
    ("run gpt --steps -1", "--steps"), ("run gpt --steps 0", "--steps"),
    ("run gpt --optimizer adamm", "--optimizer"),
    ("run gpt --optimizer-args [1]", "--optimizer-args"),
    ("train gpt --lr-schedule linear", "--lr-schedule"), ("run gpt --lr -0.1", "--lr"),
    ("run gpt --lr nan", "--lr"), ("run gpt --clip 0", "--clip"),
    ("run gpt --timeout 0", "--timeout"), ("run gpt --timeout inf", "--timeout"),
    ("timeline gpt --policy 1f1b", "--out"),
    ("timeline gpt --policy 1f1b --out {tmp}/t.txt", "--out"),
    ("timeline gpt --policy 1f1b --out {tmp}/missing/t.png", "--out"),
    ("timeline gpt --policy 1f1b --out {tmp}", "--out"),
    ("timeline gpt --policy 1f1b --out {tmp}/t.png --flops 0", "--flops"),
    ("timeline gpt --policy 1f1b --out {tmp}/t.png --bandwidth -1", "--bandwidth"),
    ("bench", "what"), ("bench dtensor", "what"),
    ("bench rvd --numel 0", "--numel"), ("bench rvd --numel -5", "--numel"),
    ("bench rvd --measure-numel 0", "--measure-numel"), ("bench rvd --repeats 0", "--repeats"),
    ("bench rvd --cluster nope", "--cluster"),
    ("bench rvd --cluster dgx-a100", "--cluster dgx-a100 has one node"),
    ("bench rvd --batch-size 4", "--batch-size"),
    ("profile --devices 0", "--devices"), ("profile --repeats 0", "--repeats"),
    ("profile --backend mpi", "--backend"), ("profile --out {tmp}/missing/c.json", "--out"),
    ("profile --out {tmp}", "--out"),
    *([("profile --backend nccl", "--backend")] if not torch.cuda.is_available() else []),
    ("nope", "command"),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("args")
    (folder / "garbage.csv").write_text("hello,world\n")
    return folder


@pytest.mark.parametrize("command, why", BAD, ids=[c for c, _ in BAD])
def test_bad_input_exits_2_with_a_one_line_reason(capsys, tmp, command, why):
    argv = shlex.split(command.format(tmp=tmp))
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    reason = err.strip().splitlines()[-1]
    assert "error:" in reason and why in reason, err
    if not reason.startswith("chronotope"):  # found after parsing: the reason is all
        assert len(err.strip().splitlines()) == 1, err


def test_bad_input_with_json_is_one_json_object_on_stdout_once_parsed(capsys):
    """Usage errors come from argparse, on stderr; what fails after parsing is one JSON
    object on stdout, which a script reads as it reads the results."""
    assert main(shlex.split("run gpt --steps -1 --json")) == 2
    out, err = capsys.readouterr()
    assert out == "" and "error:" in err
    assert main(shlex.split("plan gpt --policy tp --devices 3 --json")) == 2
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["exit_code"] == 2 and "splits nothing in gpt" in report["error"]


def test_help_exits_0_and_shows_every_default(capsys):
    assert main(["run", "--help"]) == 0
    assert "--steps" in capsys.readouterr().out
    assert main(["train", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    for option, default in (("--devices DEVICES", "4, or under torchrun its world size"),
                            ("--lr LR", "0.1"), ("--steps STEPS", "3")):
        assert f"{option} (default: {default})" in shown, option


def test_a_warning_is_one_line_naming_no_source(monkeypatch, capsys):
    """As the errors are: what it says, not the Python file and line that said it."""
    import warnings

    from chronotope import cli

    def warns(args, out, emit):
        warnings.warn("checkpoint 'x' is damaged: continuing from 'y' instead", stacklevel=1)
        return 0

    monkeypatch.setitem(cli.COMMANDS, "capture", warns)
    assert cli.main(["capture", "gpt"]) == 0
    err = capsys.readouterr().err
    assert err.strip() == "warning: checkpoint 'x' is damaged: continuing from 'y' instead"
    assert warnings.showwarning is not cli._warning_line  # given back


@pytest.mark.parametrize("optimizer,states", [("sgd", 0), ("adamw", 2)])
def test_run_and_train_plan_the_memory_of_the_optimizer_they_run(optimizer, states):
    """The plan's estimate holds the state of the optimizer the run keeps (SGD: none)."""
    from chronotope.cli import _compiled, parser

    args = parser().parse_args(["train", "gpt", "--devices", "2", "--optimizer", optimizer])
    _, program = _compiled(args)
    assert program.plan.optimizer == states
    memory = program.plan.check().memory[0]
    assert memory.optimizer == states * memory.params
