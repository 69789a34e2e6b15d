"""Scaled plans (``plan.scale``): replicas of a unit plan train like one device on the
whole batch, or are refused by name where a replica cannot run alone."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.compile.program import AllReduce, Role
from chronotope.models import get_workload
from chronotope.policies import data_parallel, mesh, tensor_parallel, zero
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim, rank_specs, run_in_threads
from chronotope.runtime.reference import compare, train_reference
from chronotope.workload import Workload
from tests.policies.plan_testing import trains_like_one_device

R = 2  # replicas


def capture(w: Workload) -> ct.Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(w)


def unit_and_whole(name: str, rows: int = 2) -> tuple[ct.Graph, Workload]:
    """The graph of one replica's rows, and the workload of all replicas' rows."""
    return (capture(get_workload(name, batch_size=rows)),
            get_workload(name, batch_size=rows * R))


@pytest.mark.parametrize("policy", [
    lambda g: tensor_parallel(g, 2),
    lambda g: mesh(g, pp=2, micro=2, schedule="1f1b"),
    lambda g: zero(g, 2, stage=3),
    lambda g: data_parallel(g, 1),
], ids=["tp", "1f1b", "zero3", "one-device"])
def test_replicas_of_a_unit_train_like_one_device_on_the_whole_batch(policy):
    graph, whole = unit_and_whole("gpt")
    program = ct.compile(policy(graph).scale(R))
    trains_like_one_device(whole, program, steps=3)


def test_every_replica_runs_replica_zeros_code_and_sums_gradients_and_the_loss_over_them():
    graph, _ = unit_and_whole("gpt")
    program = ct.compile(tensor_parallel(graph, 2).scale(R))
    code = program.code(1)
    assert program.code(3) == code  # device 1 of replica 1
    assert "ranks=(1, 3), grads=True" in code  # its gradients, summed with its replica's
    # the loss, over the replicas of device 0, in the last bucket of its gradients
    [bucket] = [ins for ins in program.ranks[0] if isinstance(ins, AllReduce)
                and any(k.role is Role.LOSS for k in ins.keys)]
    assert bucket.ranks == (0, 2) and any(k.role is Role.GRADIENT for k in bucket.keys)
    assert "grads=True, plain=(" in program.code(0)
    # the token count a mean loss divides by is the whole batch's
    assert "cross_entropy_count_pending = rt.all_reduce([(cross_entropy_count_mine,)], " \
        "ranks=(0, 2)" in program.code(0)


class MeanWithPenalty(nn.Module):
    """A mean loss plus a weight penalty: the penalty is added once, not once per replica."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, y):
        out = self.b(torch.tanh(self.a(x)))
        return F.mse_loss(out, y) + 0.1 * self.a.weight.pow(2).sum() + F.l1_loss(out, y)


def test_a_penalty_beside_a_mean_loss_counts_once_on_the_whole_batch():
    def workload(rows: int) -> Workload:
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        return Workload(MeanWithPenalty(), (torch.randn(rows, 6, generator=g),
                                            torch.randn(rows, 3, generator=g)),
                        name="penalised")
    graph = capture(workload(3))
    trains_like_one_device(workload(3 * R), ct.compile(tensor_parallel(graph, 2).scale(R)), 3)


@pytest.mark.parametrize("policy", [
    lambda g: tensor_parallel(g, 2),
    lambda g: mesh(g, pp=2, micro=2, schedule="1f1b", fold=True),
    lambda g: data_parallel(g, 1),
], ids=["tp", "1f1b-folded", "one-device"])
def test_replicas_sharing_out_the_optimizer_state_train_like_one_device(policy):
    graph, whole = unit_and_whole("gpt")
    program = ct.compile(policy(graph).scale(R, shard_optimizer=True))
    trains_like_one_device(whole, program, steps=3)
    optim = Optim("sgd", 0.1, clip=0.05)  # the norm of the whole gradient, from the runs
    diff = compare(run_in_threads(program, whole, 2, optim), train_reference(whole, 2, optim))
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff


def test_each_replica_updates_its_run_of_a_region_and_keeps_that_runs_state_only():
    graph, _ = unit_and_whole("gpt")
    plain = ct.compile(tensor_parallel(graph, 2).scale(R))
    program = ct.compile(tensor_parallel(graph, 2).scale(R, shard_optimizer=True))
    code = program.code(1)
    # its gradients reduce-scattered over its replicas, the updated runs gathered after
    assert "= rt.reduce_scatter(" in code and "ranks=(1, 3), dims=(" in code
    assert "rt.gather_params(ranks=(1, 3), params=[" in code
    region = dict(plain.updated(1))["wte.weight"]
    runs = [dict(program.updated(r))["wte.weight"] for r in (1, 3)]  # device 1, replicas 0, 1
    assert runs == [((region[0][0], region[0][0] + 256), region[1]),
                    ((region[0][0] + 256, region[0][1]), region[1])]
    ours, theirs = program.plan.check().memory[1], plain.plan.check().memory[1]
    assert ours.optimizer * R == theirs.optimizer and ours.grads == theirs.grads


def test_a_region_no_dim_of_divides_by_the_replicas_is_updated_whole_by_each():
    def workload(rows: int) -> Workload:  # b.bias has 3 elements: 2 replicas cannot split it
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        return Workload(MeanWithPenalty(), (torch.randn(rows, 6, generator=g),
                                            torch.randn(rows, 3, generator=g)),
                        name="penalised")
    plan = data_parallel(capture(workload(3)), 1).scale(R, shard_optimizer=True)
    program = ct.compile(plan)
    assert ("b.bias", ((0, 3),)) in program.updated(1) and \
        ("b.weight", ((0, 3), (4, 8))) in program.updated(1)
    trains_like_one_device(workload(3 * R), program, 3)


class SumOverRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x).pow(2).sum() / x.shape[0]  # the batch's size, taken when captured


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.a(x)).pow(2).mean()


class Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return F.dropout(self.a(x), 0.5).pow(2).mean()


def test_a_number_taken_from_the_batch_size_is_refused_when_run():
    def workload(rows: int) -> Workload:
        torch.manual_seed(0)
        return Workload(SumOverRows(), (torch.randn(rows, 4),), name="sum_over_rows")
    program = ct.compile(data_parallel(capture(workload(2)), 1).scale(R))
    with pytest.raises(ct.PlanError, match=r"plan\.scale: op .*div.*other arguments"):
        rank_specs(program, workload(2 * R))
    with pytest.raises(ct.ChronotopeError, match=r"input .* needs 2 x that many"):
        rank_specs(program, workload(3))


@pytest.mark.parametrize("model, op, why", [
    (BatchNormNet, "batch_norm_reshape", r"needs the whole of .*batch statistics"),
    (Dropout, "dropout", r"random numbers per sample"),
])
def test_what_a_replica_cannot_run_alone_is_refused_by_name_at_check(model, op, why):
    torch.manual_seed(0)
    graph = capture(Workload(model(), (torch.randn(4, 4),), name=model.__name__))
    plan = data_parallel(graph, 1).scale(R)
    with pytest.raises(ct.PlanError, match=rf"plan\.scale cannot run op {op} .*{why}"
                       r".*policies\.mesh\(graph, dp=\.\.\.\)"):
        plan.check()
    plan.scale(1).check()  # one replica: the plan as it was


@pytest.mark.slow
def test_replicas_train_like_one_device_as_processes_on_gloo():
    graph, whole = unit_and_whole("llama")
    program = ct.compile(tensor_parallel(graph, 2).scale(R))
    # SGD: Adam's update divides by the gradient's own size, so where a gradient is zero
    # in exact arithmetic (a key's weights under a softmax shift), it magnifies rounding
    # noise to a step of the learning rate and the comparison says nothing.
    run = run_processes(program, whole, 2, Optim("sgd", 0.1))
    diff = compare(run, train_reference(whole, 2, Optim("sgd", 0.1)))
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff


def test_the_thread_run_clips_on_the_norm_of_the_whole_gradient():
    graph, whole = unit_and_whole("gpt")
    program = ct.compile(tensor_parallel(graph, 2).scale(R))
    optim = Optim("sgd", 0.1, clip=0.05)
    diff = compare(run_in_threads(program, whole, 2, optim), train_reference(whole, 2, optim))
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff
