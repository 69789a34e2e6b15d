"""Templates: micro-batch 0 planned, checked and compiled, every micro-batch run from it."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.compile.program import Micro
from chronotope.errors import DeadlockError, PlanError
from chronotope.plan.steps import Kind, Step
from chronotope.policies import actions, mesh, pipeline, timeline
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim
from chronotope.runtime.reference import compare, train_reference
from tests.policies.plan_testing import captured, trains_like_one_device


@pytest.fixture(scope="module")
def gpt():
    return captured("gpt", n_layer=4, d_model=32, n_head=2, block_size=16, batch_size=8)


FOLDED = {
    "gpipe": dict(pp=2, micro=4, schedule="gpipe"),
    "1f1b": dict(pp=4, micro=4, schedule="1f1b"),
    "interleaved": dict(pp=2, micro=4, schedule="interleaved", chunks=2),
    "zb1": dict(pp=2, micro=4, schedule="zb1"),
    "zbv": dict(pp=2, micro=4, schedule="zbv", chunks=2),
    "tp x pp": dict(tp=2, pp=2, micro=2, schedule="1f1b"),
    "sp x pp": dict(tp=2, pp=2, micro=2, schedule="1f1b", sequence=True),
    "1f1b recomputed": dict(pp=2, micro=4, schedule="1f1b", recompute="full"),
    "dp x pp": dict(dp=2, pp=2, micro=2, schedule="1f1b"),
    "accumulation": dict(micro=4),
}


@pytest.mark.parametrize("name", FOLDED)
def test_a_folded_plan_trains_like_one_device_and_like_the_cut_one(gpt, name):
    """The messages each pair of ranks exchanges keep one order on both sides (the thread
    runs check it, as NCCL needs), and the order of steps is the cut plan's."""
    w, graph = gpt
    plan = mesh(graph, fold=True, **FOLDED[name])
    program = ct.compile(plan)
    trains_like_one_device(w, program)
    cut = mesh(graph, **FOLDED[name])
    if "pp" in FOLDED[name]:
        assert actions(plan) == actions(cut)
    marks = {r: [ins.index for ins in code if isinstance(ins, Micro) and ins.index is not None]
             for r, code in enumerate(program.ranks)}
    assert all(marks[d] == [m for _, _, m in steps] for d, steps in plan.steps.items())


def test_plan_check_and_compile_cost_one_micro_batch(gpt):
    """The template holds micro-batch 0's pieces whatever the number of micro-batches, and
    its estimate keeps as many micro-batches' activations as the cut plan's does (what runs
    once a step counted as one of them)."""
    _, graph = gpt
    sizes = {}
    for micro in (2, 8):
        plan = pipeline(graph, 2, micro, "1f1b", fold=True)
        sizes[micro] = sum(len(s) for s in plan.check().sequences.values())
        cut = pipeline(graph, 2, micro, "1f1b")
        for d, memory in plan.check().memory.items():  # what runs once is counted as kept
            assert memory.activations == pytest.approx(cut.check().memory[d].activations,
                                                       rel=0.05)
    assert sizes[2] == sizes[8]


def test_a_folded_timeline_is_the_cut_plans(gpt):
    _, graph = gpt
    folded, cut = (timeline(pipeline(graph, 2, 4, "1f1b", fold=f)) for f in (True, False))
    assert folded.makespan == pytest.approx(cut.makespan)
    assert folded.bubble_ratio == pytest.approx(cut.bubble_ratio)


def test_scaled_folded_plans_train_like_one_device_on_the_whole_batch(gpt):
    """Data-parallel replicas of a folded tp x pp unit (plan.scale): 1,024-rank plans are
    written this way."""
    w, _ = gpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unit = ct.capture(w.replica(2))
    program = ct.compile(mesh(unit, tp=2, pp=2, micro=2, schedule="1f1b", fold=True).scale(2))
    trains_like_one_device(w, program)


@pytest.mark.slow
def test_a_folded_pipeline_trains_like_one_device_on_gloo_processes(gpt):
    w, graph = gpt
    optim = Optim("sgd", 0.1)
    run = run_processes(ct.compile(mesh(graph, tp=2, pp=2, micro=4, schedule="1f1b",
                                        fold=True)), w, 3, optim)
    assert compare(run, train_reference(w, 3, optim)).within(1e-5)


def test_steps_that_miss_a_step_or_deadlock_are_refused(gpt):
    _, graph = gpt
    plan = pipeline(graph, 2, 2, "1f1b", fold=True)
    steps = {d: list(s) for d, s in plan.steps.items()}
    plan.micro_batches(2, {0: steps[0][:-1], 1: steps[1]})
    with pytest.raises(PlanError, match=r"device 0 .*B0\.1 missing"):
        plan.check()
    # stage 1 runs micro-batch 1's backward before its forward, and stage 0 its backward
    # before stage 1's forward of it: each waits on the other
    plan.micro_batches(2, {0: [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
                           1: [("F", 1, 0), ("B", 1, 1), ("B", 1, 0), ("F", 1, 1)]})
    with pytest.raises(DeadlockError, match="device 1: B1.1 waits for F1.1"):
        plan.check()
    # tensor-parallel peers exchange within a step: they run their steps in one order
    plan = pipeline(graph, 2, 2, "1f1b", tp=2, fold=True)
    steps = {d: list(s) for d, s in plan.steps.items()}
    steps[1] = [steps[1][1], steps[1][0], *steps[1][2:]]
    plan.micro_batches(2, steps)
    with pytest.raises(PlanError, match="devices 0 and 1 share steps"):
        plan.check()
    with pytest.raises(PlanError, match=r"device 0's step \('X', 0, 0\): a step's kind is "
                                        "one of B, F, W"):
        plan.micro_batches(2, {0: [("X", 0, 0)]})


def test_one_step_type_reads_and_writes_torch_pipelining_actions(gpt):
    """A Step is its kind, stage and micro-batch, whatever made it: a schedule, a plan's
    template steps, or a torch pipelining action (``I``: a split backward's input part)."""
    assert Step(Kind.B, 1, 0) == ("B", 1, 0) and Step(Kind.B, 1, 0).action() == "1B0"
    assert Step(Kind.B, 1, 0).action(split=True) == "1I0"
    assert Step.parse("1I0") == Step(Kind.B, 1, 0) and Step.parse("0W3").kind is Kind.W
    assert Step.parse("0SEND_F1") is None and Step.parse("0F") is None
    assert Step.parse("0FB1") is None
    _, graph = gpt
    plan = pipeline(graph, 2, 4, "zb1", fold=True)
    assert all(isinstance(s, Step) for steps in plan.steps.values() for s in steps)
    assert [s.action(split=True) for s in plan.steps[0][:3]] == actions(plan)[0][:3]


def test_a_folded_pipeline_draws_each_micro_batchs_own_random_numbers():
    """Dropout on the counter stream: each micro-batch's pieces draw its rows' numbers, as
    the cut pipeline's and one device's do."""
    w, graph = captured("gpt", n_layer=2, d_model=32, n_head=2, block_size=16, batch_size=8,
                        dropout=0.1)
    for kw in (dict(pp=2, micro=4, schedule="1f1b"), dict(pp=2, micro=4, recompute="full")):
        trains_like_one_device(w, ct.compile(mesh(graph, fold=True, **kw)))
    with pytest.raises(PlanError, match="fold runs one pipeline"):
        pipeline(graph, 2, 2, "chimera", fold=True)


def test_a_template_is_kept_in_plan_files(gpt, tmp_path):
    w, graph = gpt
    plan = pipeline(graph, 2, 4, "zb1", fold=True)
    plan.save(str(tmp_path / "plan.json"))
    loaded = ct.load_plan(graph, tmp_path / "plan.json")
    assert loaded.micro == 4 and loaded.steps == plan.steps
    assert actions(loaded) == actions(plan)
    trains_like_one_device(w, ct.compile(loaded))


def test_each_micro_batch_reads_its_rows_of_a_mask_made_once_also_when_made_again():
    """BERT's attention mask is made once a step from the inputs (and broadcast to the
    batch from a buffer) on the first stage, read on the second in every micro-batch, and
    read again where full recompute makes the attention again."""
    w, graph = captured("hf-bert")
    program = ct.compile(mesh(graph, pp=2, micro=2, schedule="1f1b", recompute="full",
                              fold=True))
    trains_like_one_device(w, program)


class LearnedWeighting(nn.Module):
    """A regression loss weighted by a learned log-variance (``exp(-s) * mse + s``): the
    loss is linear in each micro-batch's sum, and reads ``s`` in every micro-batch."""

    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
        self.s = nn.Parameter(torch.tensor(0.3))
        self.plain = plain

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mse = F.mse_loss(self.b(torch.tanh(self.a(x))).squeeze(-1), y)
        return mse + self.s if self.plain else torch.exp(-self.s) * mse + self.s


@pytest.mark.parametrize("plain", [True, False])
def test_what_every_micro_batch_makes_whole_is_read_once_not_summed(plain):
    """The gradient of ``s`` under the loss's value split is whole in each micro-batch's
    piece (a replica): the folded program takes one, as the cut one does."""
    torch.manual_seed(0)
    w = ct.Workload(LearnedWeighting(plain), (torch.randn(4, 8), torch.randn(4)))
    graph = ct.capture(w)
    for fold in (False, True):
        trains_like_one_device(w, ct.compile(pipeline(graph, 2, 2, "1f1b", fold=fold)))
