"""Batch norm in training mode under any plan: statistics over the whole batch (SyncBatchNorm),
and running statistics that end each step as on one device."""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.graph.axes import follow
from chronotope.policies import mesh, zero
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference

STEPS = 3


class BatchNormNet(nn.Module):
    """conv -> batch norm -> relu -> pool -> linear, with a classification loss."""

    def __init__(self, norm: nn.Module, dims: int = 2) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv1d
        self.conv = conv(3, 4, 3, padding=1)
        self.norm = norm
        self.head = nn.Linear(4, 5)
        self.dims = dims

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.conv(x)))
        h = h.mean(dim=tuple(range(2, 2 + self.dims)))
        return F.cross_entropy(self.head(h), y)


class FlatNorm(nn.Module):
    """BatchNorm1d on (N, C): linear -> batch norm -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 4), nn.BatchNorm1d(4, momentum=0.3), \
            nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(self.norm(self.a(x))), y)


MODELS = {
    "bn2d": lambda: BatchNormNet(nn.BatchNorm2d(4)),
    "bn2d-no-affine": lambda: BatchNormNet(nn.BatchNorm2d(4, affine=False, momentum=0.5)),
    "bn2d-no-running-stats": lambda: BatchNormNet(nn.BatchNorm2d(4, track_running_stats=False)),
    "bn1d-sequence": lambda: BatchNormNet(nn.BatchNorm1d(4), dims=1),
    "bn1d-flat": FlatNorm,
}


def workload(name: str, batch: int = 8) -> ct.Workload:
    torch.manual_seed(0)
    model = MODELS[name]()
    shape = {"bn1d-sequence": (batch, 3, 6), "bn1d-flat": (batch, 6)}.get(name, (batch, 3, 4, 4))
    return ct.Workload(model, (torch.randn(shape), torch.randint(0, 5, (batch,))))


@functools.cache
def captured(name: str, frontend: str) -> tuple[ct.Workload, ct.Graph]:
    w = workload(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w, frontend=frontend)


def assert_trains_like_one_device(plan: ct.Plan, w: ct.Workload) -> None:
    run = run_in_threads(ct.compile(plan), w, STEPS, Optim("sgd", 0.1))
    ref = train_reference(w, STEPS, Optim("sgd", 0.1))
    assert run.buffers.keys() == ref.buffers.keys()
    diff = compare(run, ref)
    assert diff.within(1e-5), diff


FRONTENDS = ["fx", "export"]


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_training_batch_norm_has_signatures_and_updates_its_buffers(name, frontend):
    w, graph = captured(name, frontend)
    assert graph.unannotated_ops() == []
    stats = {"running_mean", "running_var", "num_batches_tracked"}
    expected = set() if name == "bn2d-no-running-stats" else {f"norm.{s}" for s in stats}
    assert set(graph.buffer_updates) == expected
    assert w.model.norm.training  # capture leaves the model's own buffers alone
    if expected:
        assert int(w.model.norm.num_batches_tracked) == 0


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_data_parallel_normalizes_with_the_whole_batch(name, frontend):
    w, graph = captured(name, frontend)
    assert_trains_like_one_device(mesh(graph, dp=2), w)


@pytest.mark.parametrize("plan", ["dp4", "dp2-micro2", "zero3", "pp2", "dp2-pp2"])
def test_other_plans_keep_single_device_statistics(plan):
    w, graph = captured("bn2d", "fx")
    plans = {"dp4": lambda: mesh(graph, dp=4), "dp2-micro2": lambda: mesh(graph, dp=2, micro=2),
             "zero3": lambda: zero(graph, 2, 3), "pp2": lambda: mesh(graph, pp=2),
             "dp2-pp2": lambda: mesh(graph, dp=2, pp=2)}
    assert_trains_like_one_device(plans[plan](), w)


def test_channel_split_of_every_op_trains_like_one_device():
    """The convolution split along its output channels, and every op after it along the dim
    those channels reach (the statistics, their running averages, the head's reduction)."""
    w, graph = captured("bn2d", "fx")
    conv = next(op for op in graph if op.kind == "conv")
    channel = follow(graph, {conv.outputs[0]: 1})
    plan = ct.Plan(graph, 2)
    for op in graph:
        dim = "o" if op is conv else channel[op]
        for device, piece in enumerate(plan.trans(op, ct.Split(dim, 2) if dim
                                                  else ct.Replicate(2))):
            plan.assign(piece, device)
    assert sum(d is not None for d in channel.values()) > 10
    assert_trains_like_one_device(plan, w)


def test_buffers_that_differ_from_one_device_are_a_mismatch():
    w, graph = captured("bn2d", "fx")
    run = run_in_threads(ct.compile(mesh(graph, dp=2)), w, 1, Optim("sgd", 0.1))
    ref = train_reference(w, 1, Optim("sgd", 0.1))
    assert compare(run, ref).within(1e-5)
    run.buffers["norm.running_var"] = run.buffers["norm.running_var"] * 1.01
    assert not compare(run, ref).within(1e-5)
    del run.buffers["norm.running_mean"]
    assert compare(run, ref).max_buffer_rel_diff == float("inf")


@pytest.mark.slow
def test_worker_processes_return_the_buffers_they_updated():
    w, graph = captured("bn2d", "export")
    run = run_processes(ct.compile(mesh(graph, dp=2)), w, 2, Optim("sgd", 0.1), timeout=120)
    ref = train_reference(w, 2, Optim("sgd", 0.1))
    assert int(run.buffers["norm.num_batches_tracked"]) == 2
    assert compare(run, ref).within(1e-5)
