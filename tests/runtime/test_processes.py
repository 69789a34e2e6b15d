"""Compiled plans as real worker processes on gloo."""

import os
import subprocess
import sys
import warnings

import pytest

import chronotope as ct
from chronotope.compile import compile
from chronotope.models import get_workload
from chronotope.policies import data_parallel
from chronotope.runtime.launch import WorkerError, launch, run_processes
from chronotope.runtime.local import Optim, rank_specs
from chronotope.runtime.reference import compare, train_reference

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


def test_a_raising_worker_is_named():
    w, program = gpt_program(2)
    specs = rank_specs(program, w)
    specs[0].code = specs[0].code.replace("def step(rt):\n",
                                          "def step(rt):\n    raise ValueError('bad batch')\n")
    with pytest.raises(WorkerError, match="worker rank 0 failed: ValueError: bad batch"):
        launch(specs, 1, timeout=30)


def test_saved_program_runs_under_torchrun(tmp_path):
    w, program = gpt_program(2)
    program.save(str(tmp_path), w, steps=2)
    assert (tmp_path / "rank1.py").read_text().startswith('"""Rank 1 of 2')
    src = os.path.dirname(os.path.dirname(ct.__file__))  # importable however it was installed
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(tmp_path / "launch.py")],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    reference = train_reference(w, 2, Optim())
    printed = [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines()
               if line.startswith("step ")]
    assert printed == pytest.approx(reference.losses, rel=1e-5)
