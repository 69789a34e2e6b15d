"""What the per-op tests share: a small model around one op, a plan that splits only that op,
and the check against one device."""

import copy
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import chronotope as ct
from chronotope.graph.batch import model_loss
from chronotope.graph.ir import Op
from chronotope.graph.rng import CounterRandom
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference

STEPS = 2


class OpModel(nn.Module):
    """``loss = sum_i (i + 1) * sum(out_i ** 2)`` of ``out = op(inner, x * scale)``: the op
    reads a trained tensor, and every output (indices too) enters the loss."""

    def __init__(self, shape: tuple[int, ...], op: Callable, inner: nn.Module | None) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(shape[1:]) + 0.5)
        self.inner = inner
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.op(self.inner, x * self.scale)
        outs = out if isinstance(out, tuple) else (out,)
        loss = outs[0].float().pow(2).sum()
        for i, o in enumerate(outs[1:]):
            loss = loss + (o.float().pow(2).sum() * (i + 2))
        return loss


@dataclass(frozen=True)
class Case:
    """One op in a small model: ``op(inner, h)`` on an input of ``shape``, the kind of the
    op under test, and the dims its signature lets split."""

    shape: tuple[int, ...]
    op: Callable
    kind: str
    dims: tuple[str, ...]
    inner: Callable[[], nn.Module] | None = None
    frontends: tuple[str, ...] = ("fx", "export")
    tolerance: float = 1e-5  # bfloat16 partial sums (of a split or of its backward) round off

    def workload(self) -> ct.Workload:
        torch.manual_seed(0)
        inner = self.inner() if self.inner else None
        return ct.Workload(OpModel(self.shape, self.op, inner), (torch.randn(self.shape),))

    def captured(self, frontend: str) -> tuple[ct.Workload, ct.Graph]:
        w = self.workload()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return w, ct.capture(w, frontend=frontend)


def layer(module: Callable[[], nn.Module], shape: tuple[int, ...], kind: str,
                dims: tuple[str, ...]) -> Case:
    """A case whose op is a module's forward."""
    return Case(shape, lambda m, h: m(h), kind, dims, inner=module)


def split_one(graph: ct.Graph, op: Op, dim: str, n: int = 2) -> ct.Plan:
    """``op`` split ``n`` ways along ``dim`` (piece k on device k), everything else replicated."""
    plan = ct.Plan(graph, n)
    for o in graph:
        for device, piece in enumerate(plan.trans(o, ct.Split(dim, n) if o is op
                                                  else ct.Replicate(n))):
            plan.assign(piece, device)
    return plan


def trains_like_one_device(plan: ct.Plan, w: ct.Workload, steps: int = STEPS,
                           tolerance: float = 1e-5) -> None:
    """Losses, weights and buffers within float32 tolerance of training on one device."""
    run = run_in_threads(ct.compile(plan), w, steps, Optim("sgd", 0.1))
    diff = compare(run, train_reference(w, steps, Optim("sgd", 0.1)))
    assert diff.within(tolerance), diff


def eager_step(w: ct.Workload, seed: int = 0):
    """Loss and parameter gradients of (a copy of) the model run as written (random ops on
    the counter-based stream, as captured ones are); the model's buffers stay as they are."""
    model = copy.deepcopy(w.model)
    torch.manual_seed(seed)
    with CounterRandom():
        out = model(*w.inputs, **w.kwargs)
        loss = w.loss_fn(out, *w.targets) if w.loss_fn else model_loss(out)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def graph_step(graph: ct.Graph, w: ct.Workload, seed: int = 0):
    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = ct.execute(graph, w)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in w.model.named_parameters() if p.grad is not None}
    w.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same_step(graph: ct.Graph, w: ct.Workload, rtol: float = 1e-6):
    ref_loss, ref_grads = eager_step(w)
    loss, grads = graph_step(graph, w)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        scale = ref_grads[name].abs().max().clamp_min(1e-12)
        assert ((g - ref_grads[name]).abs().max() / scale).item() <= rtol, name


def the_op(graph: ct.Graph, kind: str) -> Op:
    found = [op for op in graph if op.kind == kind]
    assert len(found) == 1, [op.kind for op in graph]
    return found[0]


def per_op_tests(cases: dict[str, Case]) -> tuple[Callable, Callable]:
    """The two tests of a table of cases, for a test module to bind at its top level: the
    op's signature lets split exactly the case's dims, and a split along each of them
    trains like one device. Each case is captured once per frontend."""

    @functools.cache
    def captured(name: str, frontend: str) -> tuple[ct.Workload, ct.Graph]:
        return cases[name].captured(frontend)

    @pytest.mark.parametrize("name, frontend", [(n, f) for n, c in cases.items()
                                                for f in c.frontends])
    def test_signature_names_the_dims_that_split(name: str, frontend: str) -> None:
        _, graph = captured(name, frontend)
        op = the_op(graph, cases[name].kind)
        assert op.signature is not None, op.note
        assert sorted(op.signature.splittable()) == sorted(cases[name].dims), str(op.signature)

    @pytest.mark.parametrize("name, frontend, dim", [(n, f, d) for n, c in cases.items()
                                                     for f in c.frontends for d in c.dims])
    def test_split_along_each_dim_trains_like_one_device(name: str, frontend: str,
                                                         dim: str) -> None:
        w, graph = captured(name, frontend)
        plan = split_one(graph, the_op(graph, cases[name].kind), dim)
        trains_like_one_device(plan, w, tolerance=cases[name].tolerance)

    return (test_signature_names_the_dims_that_split,
            test_split_along_each_dim_trains_like_one_device)
