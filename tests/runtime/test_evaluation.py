"""A plan's evaluation (``Plan.evaluation``): the forward alone, dropout off, on the regions
the ranks train; its loss is ``model.eval()``'s on one device, under every kind of plan."""

import functools
import threading
import warnings
from pathlib import Path

import pytest
import torch

import chronotope as ct
from chronotope.cli import main
from chronotope.errors import PlanError
from chronotope.models import get_workload, load_function
from chronotope.policies import ParallelConfig, make, mesh, pipeline
from chronotope.runtime.data import DataRandom
from chronotope.runtime.local import Rank, rank_specs
from chronotope.runtime.train import train
from chronotope.runtime.transport import OrderedTransport

DATA = f"{Path(__file__).parent / 'train_data.py'}"
PLANS = {
    "dp": ParallelConfig("dp", 2),
    "tp": ParallelConfig("tp", 2),
    "sp": ParallelConfig("sp", 2),
    "dp-tp": ParallelConfig("dp-tp", 4, tp=2),
    "zero3": ParallelConfig("zero-3", 2),
    "1f1b": ParallelConfig("1f1b", 2, micro=2, fold=False),
    "1f1b-fold": ParallelConfig("1f1b", 2, micro=4),
    "interleaved": ParallelConfig("interleaved", 2, micro=2, chunks=2, fold=False),
    "zb1": ParallelConfig("zb1", 2, micro=2, fold=False),
    "recompute": ParallelConfig("dp", 2, recompute="full"),
}


@functools.cache
def gpt(batch_size: int = 4, dropout: float = 0.2):
    """A GPT whose dropout is on: an evaluation must turn it off."""
    w = get_workload("gpt", dropout=dropout, batch_size=batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


def one_device(w) -> float:
    model = w.model
    model.eval()
    try:
        with torch.no_grad():
            return float(model(*w.inputs))
    finally:
        model.train()


def evaluated(program, w) -> float:
    """Every rank's evaluation of the example batch, as threads; the loss rank 0 reports."""
    transport = OrderedTransport(30)
    ranks = [Rank(spec, transport, ct.Optim())
             for spec in rank_specs(program, w, evaluation=ct.compile(
                 program.plan.evaluation()))]
    losses: dict[int, list[float]] = {}

    def work(rank: Rank) -> None:
        losses[rank.rank] = rank.evaluate()

    threads = [threading.Thread(target=work, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = [x for r in sorted(losses) for x in losses[r]]
    assert held, "no rank holds the loss"
    return sum(held) / len(held)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_the_evaluation_of_every_kind_of_plan_gives_the_loss_of_model_eval(plan):
    w, graph = gpt()
    program = ct.compile(make(graph, PLANS[plan]))
    assert evaluated(program, w) == pytest.approx(one_device(w), rel=1e-5)


def test_a_scaled_plans_replicas_evaluate_their_rows():
    w, _ = gpt(dropout=0.0)  # a scaled plan has no dropout (plan.scale refuses it)
    _, unit = gpt(batch_size=2, dropout=0.0)
    program = ct.compile(mesh(unit, tp=2).scale(2))
    assert evaluated(program, w) == pytest.approx(one_device(w), rel=1e-5)


def test_the_evaluation_has_no_backward_and_no_gradient_sums():
    _, graph = gpt()
    program = ct.compile(pipeline(graph, 2, 2, "1f1b").evaluation())
    code = "\n".join(program.code(r) for r in range(2))
    assert "rt.backward" not in code and "rt.grad(" not in code
    dp = ct.compile(mesh(graph, dp=2).evaluation()).code(0)
    sums = [line for line in dp.splitlines() if "rt.all_reduce(" in line]
    assert sums and all("cross_entropy" in line for line in sums)  # the loss's, no gradient's
    assert "rt.grad(" not in dp


def test_a_forward_that_updates_buffers_is_refused_for_evaluation():
    """Batch norm in training mode normalizes with the batch's statistics: not eval's."""
    from tests.zoo.models import cnn_bn

    w = cnn_bn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    with pytest.raises(PlanError, match="updates buffers in its forward .*running_mean"):
        mesh(graph, dp=2).evaluation()


def test_evaluate_options_without_eval_data_are_refused(capsys):
    assert main(["train", "gpt", "--devices", "2", "--steps", "1", "--eval-every", "1"]) == 2
    assert "give it too" in capsys.readouterr().err


@pytest.mark.slow
def test_training_on_gloo_reports_the_validation_loss_of_one_device(tmp_path, capsys):
    """``chronotope train --eval-data``: every K steps and after the last, the mean loss of
    the validation batches under the trained weights, as one device in eval mode has it;
    training itself is unchanged by the evaluations between its steps."""
    w, graph = gpt()
    program = ct.compile(pipeline(graph, 2, 2, "1f1b"))
    plain = train(program, w, f"{DATA}:tokens", 4, seed=1)
    result = train(program, w, f"{DATA}:tokens", 4, seed=1, eval_data=f"{DATA}:tokens",
                   eval_every=3, eval_batches=2)
    assert result.losses == plain.losses
    assert [r["step"] for r in result.records if "eval_loss" in r] == [3, 4]
    w.model.load_state_dict(result.params, strict=False)
    assert result.records[-1]["eval_loss"] == pytest.approx(
        eval_mean(w.model, f"{DATA}:tokens", 2, seed=1), rel=1e-5)

    metrics = tmp_path / "m.jsonl"
    assert main(["train", "gpt", "--devices", "2", "--steps", "2", "--data", f"{DATA}:tokens",
                 "--eval-data", f"{DATA}:tokens", "--eval-batches", "1",
                 "--metrics", str(metrics)]) == 0
    assert "eval loss" in capsys.readouterr().out
    assert "eval_loss" in metrics.read_text().splitlines()[-1]


def eval_mean(model, data: str, batches: int, seed: int) -> float:
    """The mean loss of the first ``batches`` batches of ``data`` on one device in eval
    mode, the data read with the generators every rank reads it with."""
    rng, losses = DataRandom(seed), []
    with rng:
        it = iter(load_function(data)())
    model.eval()
    try:
        for _ in range(batches):
            with rng:
                x, y = next(it)
            with torch.no_grad():
                losses.append(float(model(x, y)))
    finally:
        model.train()
    return sum(losses) / len(losses)
