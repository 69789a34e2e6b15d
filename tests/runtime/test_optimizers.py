"""Any torch.optim optimizer and learning-rate scheduler trains a plan like one device: each
rank's optimizer over the regions it updates, its rates from one schedule."""

import functools
import json
import warnings

import pytest
import torch

import chronotope as ct
from chronotope.cli import main
from chronotope.models import get_workload
from chronotope.policies import data_parallel, mesh, zero
from chronotope.runtime.local import run_in_threads
from chronotope.runtime.optim import Optim, OptimError, Rates
from chronotope.runtime.reference import compare, train_reference

STEPS = 3


@functools.cache
def llama():
    """A model with no parameter whose gradient is zero in exact arithmetic (gpt's key
    biases): adaptive optimizers turn the rounding noise of such a gradient, which differs
    between any two orders of summation, into whole steps."""
    w = get_workload("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


def difference(plan: ct.Plan, optim: Optim, steps: int = STEPS):
    w, _ = llama()
    return compare(run_in_threads(ct.compile(plan), w, steps, optim),
                   train_reference(w, steps, optim))


class Lion(torch.optim.Optimizer):
    """A user's own optimizer (sign of an interpolated momentum): elementwise, which
    chronotope cannot know unless told."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


# eps well above float32's rounding of the gradients: where a gradient is about as small as
# its rounding, an update of g / (sqrt(v) + eps) would be decided by the rounding alone
@pytest.mark.parametrize("optimizer, options", [
    (torch.optim.Adam, {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-4}),
    ("torch.optim.Adam", {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1, "eps": 1e-4}),
    ("RMSprop", {"lr": 1e-3, "momentum": 0.5, "centered": True, "eps": 1e-4}),
    ("adagrad", {"lr": 0.05, "lr_decay": 0.01, "eps": 1e-3}),
    ("NAdam", {"lr": 1e-2, "eps": 1e-4}), ("RAdam", {"lr": 1e-2, "eps": 1e-4}),
    ("Adamax", {"lr": 1e-2, "eps": 1e-4}), ("Adadelta", {"lr": 1.0, "eps": 1e-4}),
    ("ASGD", {"lr": 0.05}), ("Rprop", {"lr": 1e-3}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
])
def test_an_elementwise_optimizer_on_split_and_sharded_regions_trains_like_one_device(
        optimizer, options):
    _, graph = llama()  # tensor-parallel regions, their optimizer state sharded over dp
    diff = difference(zero(graph, 4, 3, tp=2), Optim(optimizer, **options))
    assert diff.within(1e-5), diff


def test_an_optimizer_not_known_to_be_elementwise_is_refused_on_split_regions():
    _, graph = llama()
    with pytest.raises(OptimError, match=r"Adafactor is not known to be elementwise, and this "
                                         r"plan has a rank update part \[.*\] of "):
        difference(mesh(graph, 1, 2), Optim("Adafactor", 1e-2))
    with pytest.raises(OptimError, match="test_optimizers.Lion is not known to be elementwise"):
        difference(mesh(graph, 1, 2), Optim(Lion, 1e-3))
    # whole parameters where they are updated: any optimizer
    assert difference(data_parallel(graph, 2), Optim("Adafactor", 1e-2)).within(1e-5)
    # a user's optimizer said to be elementwise may have its parameters split
    assert difference(mesh(graph, 1, 2), Optim(Lion, 1e-3, elementwise=True)).within(1e-5)


@pytest.mark.parametrize("schedule, options, optim", [
    ("StepLR", {"step_size": 1, "gamma": 0.1}, {}),
    ("torch.optim.lr_scheduler.ExponentialLR", {"gamma": 0.5}, {"warmup": 2}),
    ("OneCycleLR", {"max_lr": 0.5, "total_steps": STEPS}, {"momentum": 0.9}),  # cycles momentum
    ("CosineAnnealingWarmRestarts", {"T_0": 2}, {}),
])
def test_any_torch_scheduler_sets_the_same_rates_on_every_rank_as_on_one_device(
        schedule, options, optim):
    _, graph = llama()
    scheduled = Optim("sgd", 0.1, schedule=schedule, schedule_options=options, **optim)
    plan = mesh(graph, 2, 2)
    diff = difference(plan, scheduled)
    constant = compare(run_in_threads(ct.compile(plan), llama()[0], STEPS, scheduled),
                       train_reference(llama()[0], STEPS, Optim("sgd", 0.1, **{
                           k: v for k, v in optim.items() if k != "warmup"})))
    assert diff.within(1e-5) and not constant.within(1e-5), (diff, constant)


def test_rates_follow_torch_and_resume_from_their_state_or_by_replay():
    optim = Optim("adamw", 1.0, schedule="cosine", warmup=3, min_lr=0.1)
    model = torch.nn.Linear(2, 2)
    opt = optim.build(model.parameters())
    torch_rates = optim.scheduler(opt, 10)
    rates, seen = Rates(optim, 10), []
    for _ in range(10):
        assert rates.lr == opt.param_groups[0]["lr"]
        seen.append(rates.lr)
        opt.step()
        torch_rates.step()
        rates.advance()
    assert seen[:3] == [1 / 3, 2 / 3, 1.0] and seen[-1] > 0.1
    saved = Rates(optim, 10)
    for _ in range(4):
        saved.advance()
    from_state, replayed = Rates(optim, 10), Rates(optim, 10)
    from_state.load(saved.state_dict(), 4)
    replayed.load(None, 4)
    assert from_state.lr == replayed.lr == seen[4]
    plateau = Rates(Optim("sgd", schedule="ReduceLROnPlateau",
                          schedule_options={"patience": 0}), 10)
    with pytest.raises(OptimError, match="steps on the loss"):
        plateau.advance()
    with pytest.raises(OptimError, match="does not record"):
        plateau.load(None, 3)


def test_optimizers_are_named_and_bad_ones_refused_with_a_reason():
    assert Optim("ADAMW").name == "adamw" and Optim(torch.optim.Adam).name == "Adam"
    assert Optim(Lion).name == "test_optimizers.Lion"
    with pytest.raises(OptimError, match="unknown optimizer 'Adamm'.*Adagrad, Adam, AdamW"):
        Optim("Adamm")
    with pytest.raises(OptimError, match="LBFGS cannot train a plan: .*closure"):
        Optim("LBFGS")
    with pytest.raises(OptimError, match="Rprop has no weight_decay"):
        Optim("Rprop", weight_decay=0.1)
    with pytest.raises(OptimError, match="cannot build Adam .*'nonsense'"):
        Optim("Adam", nonsense=1).build(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(OptimError, match="cannot build StepLR"):
        Rates(Optim("sgd", schedule="StepLR"), 3)  # step_size missing


def test_the_memory_estimate_counts_the_state_the_optimizer_keeps():
    assert [Optim(o, **kw).states for o, kw in [
        ("sgd", {}), ("sgd", {"momentum": 0.9}), ("adamw", {}), ("Adam", {"amsgrad": True}),
        ("Adagrad", {})]] == [0, 1, 2, 3, 1]
    _, graph = llama()
    adagrad, adamw = (zero(graph, 2, 1) for _ in range(2))
    adagrad.optimizer, adamw.optimizer = Optim("Adagrad").states, Optim("adamw").states
    assert adamw.check().memory_of(0).optimizer == 2 * adagrad.check().memory_of(0).optimizer > 0


@pytest.mark.slow
def test_cli_run_checks_an_optimizer_given_by_name_and_arguments(capsys):
    assert main(["run", "llama", "--policy", "tp", "--devices", "2", "--steps", "2", "--check",
                 "--optimizer", "torch.optim.RMSprop", "--lr", "0.001",
                 "--optimizer-args", '{"momentum": 0.5, "alpha": 0.9, "eps": 1e-4}',
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["match"] and report["max_param_rel_diff"] <= 1e-5, report
