"""Compiled plans as real worker processes on gloo."""

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from exported import exported

import chronotope as ct
from chronotope.cli import main
from chronotope.compile import compile
from chronotope.models import get_workload, load_workload
from chronotope.policies import ParallelConfig, data_parallel, make
from chronotope.runtime.launch import WorkerError, launch, run_processes, spawn
from chronotope.runtime.local import Optim, rank_specs
from chronotope.runtime.reference import compare, train_reference
from chronotope.runtime.targets import Target

MODELS = Path(__file__).parents[1] / "models"

pytestmark = pytest.mark.slow


def gpt_program(n: int):
    w = get_workload("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    return w, compile(data_parallel(graph, n))


def test_data_parallel_on_gloo_matches_one_device():
    w, program = gpt_program(2)
    run = run_processes(program, w, 3, Optim("adamw", 1e-3))
    diff = compare(run, train_reference(w, 3, Optim("adamw", 1e-3)))
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff


def test_a_killed_worker_is_named_and_the_others_stop():
    w, program = gpt_program(2)
    specs = rank_specs(program, w)
    kill = "def step(rt):\n    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    specs[1].code = specs[1].code.replace("def step(rt):\n", kill)
    with pytest.raises(WorkerError, match="worker rank 1 died"):
        launch(specs, 1, timeout=30)


def test_a_worker_that_aborts_after_its_work_is_done_loses_nothing():
    """gloo (or NCCL) aborting in a worker's teardown, after every rank wrote its result:
    the run's results stand, as a crash at exit ("terminate called ...") loses nothing."""
    w, program = gpt_program(2)
    specs = rank_specs(program, w)
    expected = launch(specs, 1, timeout=30)
    abort = "def step(rt):\n    import atexit, os\n    atexit.register(os.abort)\n"
    specs[1].code = specs[1].code.replace("def step(rt):\n", abort)
    got = launch(specs, 1, timeout=30)
    assert [r[0] for r in got] == [r[0] for r in expected]


def test_a_raising_worker_is_named():
    w, program = gpt_program(2)
    specs = rank_specs(program, w)
    specs[0].code = specs[0].code.replace("def step(rt):\n",
                                          "def step(rt):\n    raise ValueError('bad batch')\n")
    with pytest.raises(WorkerError, match="worker rank 0 failed: ValueError: bad batch"):
        launch(specs, 1, timeout=30)


def test_exported_ops_train_in_worker_processes_as_on_one_device():
    w, graph = exported()
    run = run_processes(compile(data_parallel(graph, 2)), w, 2, Optim("sgd", 0.1))
    diff = compare(run, train_reference(w, 2, Optim("sgd", 0.1)))
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff


def test_an_op_registered_in_the_users_file_trains_from_the_command_line(capsys):
    argv = ["run", f"{MODELS / 'user_ops_model.py'}:make", "--devices", "2", "--steps", "2",
            "--check", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_loss_rel_diff"] <= 1e-5 and report["max_param_rel_diff"] <= 1e-5


def test_a_worker_that_cannot_load_its_arguments_says_why():
    model = load_workload(f"{MODELS / 'user_model.py'}:make").model  # a class of the user's file
    with pytest.raises(WorkerError, match="worker rank [01] failed: ModuleNotFoundError: "
                                          "No module named '_chronotope_user_"):
        spawn(print, 2, (model,), timeout=30)


def test_a_worker_that_cannot_find_an_op_names_it_and_its_file():
    w, program = gpt_program(2)
    specs = rank_specs(program, w)
    op = next(iter(specs[1].targets))
    # rank 1's alone (the ranks' specs share one table of targets)
    specs[1].targets = {**specs[1].targets,
                        op: Target("_chronotope_user_gone", "scale", "/nowhere/gone.py")}
    with pytest.raises(WorkerError, match=rf"worker rank 1 failed: TargetError: op {op} runs "
                                          r"scale of .*/nowhere/gone\.py"):
        launch(specs, 1, timeout=30)


def torchrun(directory: Path) -> list[float]:
    """The losses ``torchrun`` prints for a saved program, run from its folder."""
    src = os.path.dirname(os.path.dirname(ct.__file__))  # importable however it was installed
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(directory / "launch.py")],
        capture_output=True, text=True, timeout=300, env=env, cwd=directory,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines()
            if line.startswith("step ")]


def test_saved_program_runs_under_torchrun(tmp_path):
    w, program = gpt_program(2)
    ct.save(program, w, str(tmp_path), steps=2)
    assert (tmp_path / "rank1.py").read_text().startswith('"""Rank 1 of 2')
    assert torchrun(tmp_path) == pytest.approx(train_reference(w, 2, Optim()).losses, rel=1e-5)


def test_a_saved_program_with_an_op_of_the_users_file_runs_under_torchrun(tmp_path):
    w = load_workload(f"{MODELS / 'user_ops_model.py'}:make")
    program = compile(data_parallel(ct.capture(w), 2))
    ct.save(program, w, str(tmp_path), steps=2)
    assert torchrun(tmp_path) == pytest.approx(train_reference(w, 2, Optim()).losses, rel=1e-5)


def test_a_loss_broadcast_inside_a_pipeline_step_is_waited_on_in_that_step():
    """An lm_head whose vocabulary does not divide by tp runs on a tensor-parallel root,
    which broadcasts each micro-batch's loss: the root waits on each broadcast before its
    step ends (no step hands a handle on to the next), and the run equals one device."""
    w = get_workload("gpt", batch_size=4, vocab_size=511)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = compile(make(ct.capture(w), ParallelConfig("dp-tp", 8, tp=4, pp=2, micro=4)))
    roots = [r for r in range(8) if re.search(r"_sent\w*_pending = rt\.broadcast", program.code(r))]
    assert roots, "no rank broadcasts in a step: the test no longer covers the case"
    for rank in roots:
        assert not re.search(r"_pending(, \w+)* = stage\w+\(", program.code(rank)), rank
    run = run_processes(program, w, 2, Optim("adamw", 1e-3))
    diff = compare(run, train_reference(w, 2, Optim("adamw", 1e-3)))
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff
