"""Compiled plans as real worker processes on gloo."""

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
