"""What ops call, sent to other processes as references they can follow."""

import operator
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from exported import exported
from torch import nn

import chronotope as ct
from chronotope.models import Workload, load_workload
from chronotope.runtime.launch import WorkerError, launch, spawn
from chronotope.runtime.local import rank_specs
from chronotope.runtime.targets import Target, TargetError, reference
from chronotope.runtime.train import save

USER_OPS = Path(__file__).parents[1] / "models" / "user_ops_model.py"


def round_trip(fn):
    target = reference(fn)
    assert isinstance(target, Target), fn
    return pickle.loads(pickle.dumps(target)).resolve("op")


def test_exported_aten_ops_are_sent_by_name():
    """The exported graph's aten ops, and what capture writes a mean loss as: a sum over
    a count of the counted labels (chronotope's own function), divided."""
    _, graph = exported()
    assert graph.frontend == "export"
    for op in graph.ops:
        assert isinstance(op.target, torch._ops.OpOverload) or \
            op.target.__module__.startswith(("chronotope.", "_operator")), op
        assert round_trip(op.target) is op.target


@pytest.mark.parametrize("fn", [F.max_pool2d, torch.relu, F.linear, operator.getitem,
                                torch.ops.aten.relu, torch.ops.higher_order.cond])
def test_torch_functions_are_sent_by_name(fn):
    assert round_trip(fn) is fn  # max_pool2d is a local function of torch, public as F's


def test_a_user_file_op_is_loaded_again_from_its_file(monkeypatch):
    w = load_workload(f"{USER_OPS}:make")
    graph = ct.capture(w)
    (op,) = [op for op in graph.ops if op.kind == "clipped_scale"]
    target = rank_specs(ct.compile(ct.policies.data_parallel(graph, 2)), w)[0].targets[op.name]
    assert isinstance(target, Target) and target.file == str(USER_OPS.resolve())
    monkeypatch.delitem(sys.modules, target.module)  # as in a new process
    fn = pickle.loads(pickle.dumps(target)).resolve(op.name)
    assert fn is not op.target and fn.__wrapped__.__code__.co_filename == target.file
    x, scale = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(fn(x, scale), x * scale)


def test_a_target_that_cannot_load_names_the_op_and_the_file():
    gone = Target("_chronotope_user_gone", "scale", "/nowhere/gone.py")
    with pytest.raises(TargetError, match=r"op scale_0 runs scale .*/nowhere/gone\.py"):
        gone.resolve("scale_0")


def local_op_graph():
    @ct.register_op("b d -> b d")
    def doubled(x):
        return 2 * x

    model = nn.Linear(4, 4)
    w = Workload(model, (torch.randn(2, 4),), loss_fn=lambda out: doubled(out).sum())
    return w, ct.capture(w)


def test_an_op_defined_inside_a_function_is_refused_before_workers_start(tmp_path):
    w, graph = local_op_graph()
    program = ct.compile(ct.policies.data_parallel(graph, 2))
    with pytest.raises(TargetError, match=r"op doubled runs local_op_graph.<locals>.doubled "
                                          r"\(.*test_targets.py:\d+\).*top level"):
        launch(rank_specs(program, w), 1)
    with pytest.raises(TargetError, match="op doubled"):
        save(program, w, str(tmp_path))


def test_an_argument_that_cannot_be_sent_is_named_before_workers_start():
    with pytest.raises(WorkerError, match="cannot send print and its arguments to worker"):
        spawn(print, 2, (lambda: 0,))


def test_a_saved_exported_program_loads_its_ops_by_name(tmp_path):
    w, graph = exported()
    save(ct.compile(ct.policies.data_parallel(graph, 2)), w, str(tmp_path), steps=1)
    specs = torch.load(tmp_path / "program.pt", weights_only=False)["specs"]
    targets = specs[1].targets
    assert targets and all(isinstance(t, Target) for t in targets.values())
    assert {t.resolve(op) for op, t in targets.items()} == {op.target for op in graph.ops}


CUSTOM_OP = '''
import torch


@torch.library.custom_op("chronotope_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2
'''


def test_a_custom_op_names_the_module_that_registers_it(tmp_path, monkeypatch):
    """torch.ops knows a torch.library custom op (a Hugging Face MoE's grouped matmul) only
    once its module ran: a new process imports that module before looking the op up."""
    (tmp_path / "custom_twice.py").write_text(CUSTOM_OP)
    monkeypatch.syspath_prepend(str(tmp_path))
    import custom_twice  # noqa: F401

    target = reference(torch.ops.chronotope_test.twice.default)
    assert target.registers == "custom_twice"
    found = subprocess.run(
        [sys.executable, "-c", "import pickle, sys, torch; "
         "t = pickle.loads(sys.stdin.buffer.read()); "
         "print(t.resolve('twice')(torch.ones(2)).tolist())"],
        input=pickle.dumps(target), capture_output=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    assert found.returncode == 0, found.stderr.decode()
    assert found.stdout.decode().strip() == "[2.0, 2.0]"
