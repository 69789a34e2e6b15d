"""The parts of a training run, in one process: who writes which chunk of a checkpoint,
optimizer groups and schedules, batches and their shapes, weights to start from."""

import json
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import chronotope as ct
from chronotope.models import get_workload
from chronotope.policies import mesh, pipeline, zero
from chronotope.runtime import checkpoint
from chronotope.runtime.checkpoint import CheckpointError, load_weights, writers
from chronotope.runtime.data import Batches, BatchLayout, DataError, DataRandom
from chronotope.runtime.metrics import JsonlLog, read_jsonl
from chronotope.runtime.optim import Optim, OptimError, Rates
from chronotope.viz import plot_losses

SHAPE = (6, 8)


def box(draw, shape=SHAPE):
    out = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        out.append((lo, draw(st.integers(lo + 1, n))))
    return tuple(out)


@st.composite
def holdings(draw):
    ranks = draw(st.integers(1, 4))
    return [{"w": [box(draw) for _ in range(draw(st.integers(0, 2)))]} for _ in range(ranks)]


@settings(max_examples=150, deadline=None)
@given(holdings())
def test_every_held_element_is_written_once_by_a_rank_that_holds_it(held):
    held = [{n: b for n, b in h.items() if b} for h in held]
    if not any(held):
        return
    written = torch.zeros(SHAPE, dtype=torch.int64)
    holds = torch.zeros((len(held), *SHAPE), dtype=torch.bool)
    for r, h in enumerate(held):
        for b in h.get("w", ()):
            holds[r][tuple(slice(lo, hi) for lo, hi in b)] = True
    for r, boxes in enumerate(writers(held)):
        for b in boxes.get("w", ()):
            where = tuple(slice(lo, hi) for lo, hi in b)
            assert holds[r][where].all()
            written[where] += 1
    assert torch.equal(written, holds.any(0).long())


def test_replicas_share_the_writing():
    full = ((0, 4), (0, 4))
    split = writers([{"a": [full], "b": [full]}, {"a": [full], "b": [full]}])
    assert split == [{"a": [full]}, {"b": [full]}]


@pytest.mark.parametrize("policy", ["tp", "zero-3", "1f1b"])
def test_a_programs_checkpoint_covers_every_parameter_once(policy):
    w = get_workload("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    plan = {"tp": lambda: mesh(graph, tp=2), "zero-3": lambda: zero(graph, 2, 3),
            "1f1b": lambda: pipeline(graph, 2, 2, "1f1b")}[policy]()
    program = ct.compile(plan)
    writes = checkpoint.plan_writes(program)
    for name, p in graph.params.items():
        count = torch.zeros(p.shape, dtype=torch.int64)
        for part in ("params", "optim"):
            count.zero_()
            for wr in writes:
                for b in getattr(wr, part).get(name, ()):
                    count[tuple(slice(lo, hi) for lo, hi in b)] += 1
            assert torch.equal(count, torch.ones_like(count)), (name, part)


def test_weight_decay_skips_biases_and_norm_scales_and_the_schedule_warms_up_then_decays():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    groups = Optim("adamw", 1.0, weight_decay=0.1).build(model.parameters()).param_groups
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(1, 0.1), (3, 0.0)]
    assert len(Optim(weight_decay=0.1, decay_all=True).build(model.parameters())
               .param_groups) == 1
    rates = Rates(Optim(lr=1.0, schedule="cosine", warmup=4, min_lr=0.1), 14)
    seen = []
    for _ in range(15):
        seen.append(rates.lr)
        rates.advance()
    assert seen[:4] == [0.25, 0.5, 0.75, 1.0]
    assert seen[9] == pytest.approx(0.55) and seen[14] == pytest.approx(0.1)
    constant = Rates(Optim(lr=0.3), 10)
    for _ in range(100):
        constant.advance()
    assert constant.lr == 0.3
    with pytest.raises(OptimError, match="unknown learning-rate schedule 'linear'"):
        Optim(schedule="linear")


def layout(w):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BatchLayout.of(w, ct.capture(w))


def test_batches_take_the_example_batchs_form_and_name_what_does_not_fit():
    w = get_workload("gpt")
    gpt = layout(w)
    idx, targets = w.inputs
    assert set(gpt.tensors((idx, targets), 0)) == {"idx", "targets"}
    assert set(gpt.tensors([idx, targets], 0)) == {"idx", "targets"}
    with pytest.raises(DataError, match="batch 3 is a tuple of 1; expected a tuple of 2: "
                                        "2 model inputs"):
        gpt.tensors((idx,), 3)
    with pytest.raises(DataError, match="batch 0 is a dict"):
        gpt.tensors({"idx": idx}, 0)
    with pytest.raises(DataError, match="input 'targets' is \\(4, 32\\) float32 but the plan "
                                        "was made for \\(4, 32\\) int64"):
        gpt.tensors((idx, targets.float()), 0)
    hf = get_workload("hf-bert")
    keywords = layout(hf)
    assert set(keywords.tensors(dict(hf.kwargs), 0)) == set(keywords.names)
    with pytest.raises(DataError, match="expected a dict with keys 'input_ids'"):
        keywords.tensors(tuple(hf.kwargs.values()), 0)


def test_a_pass_over_the_data_repeats_and_a_one_shot_iterator_says_so():
    w = get_workload("gpt")
    batches = [(w.inputs[0] + i, w.inputs[1]) for i in range(3)]
    seen = [int(b["idx"][0, 0]) for _, b in zip(range(7), Batches(batches, layout(w)))]
    first = int(w.inputs[0][0, 0])
    assert seen == [first + i for i in (0, 1, 2, 0, 1, 2, 0)]
    once = Batches(iter(batches), layout(w))
    with pytest.raises(DataError, match="ran out after 3 batches"):
        [next(once) for _ in range(4)]
    with pytest.raises(DataError, match="gives no batches"):
        next(Batches([], layout(w)))
    resumed = Batches(batches, layout(w), start=4)
    assert int(next(resumed)["idx"][0, 0]) == first + 1


def test_the_datas_shuffling_is_seeded_apart_from_what_training_draws():
    loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True)

    def order(seed, noise):
        rng, out = DataRandom(seed), []
        with rng:
            it = iter(loader)
        for _ in range(4):
            torch.rand(noise)  # training drawing from torch's generator in between
            with rng:
                out += next(it)[0].tolist()
        return out

    assert order(0, 1) == order(0, 5) != order(1, 1)
    assert sorted(order(0, 1)) == list(range(16))


def test_the_newest_complete_checkpoint_is_found_and_partial_ones_are_named(tmp_path):
    (tmp_path / "step-00000004.incomplete").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint .*\\(incomplete, from a run "
                                              "stopped while saving: step-00000004.incomplete"):
        checkpoint.latest(tmp_path)
    with pytest.raises(CheckpointError, match="no such folder"):
        checkpoint.latest(tmp_path / "nowhere")


def test_weights_load_from_a_hugging_face_folder_with_tied_weights_left_out(tmp_path):
    source, fresh = get_workload("hf-gpt2", seed=1).model, get_workload("hf-gpt2").model
    source.save_pretrained(tmp_path)  # writes wte once: lm_head.weight is tied to it
    load_weights(fresh, tmp_path)
    for (name, a), b in zip(fresh.named_parameters(), source.parameters()):
        assert torch.equal(a, b), name


def test_weights_that_do_not_fit_are_named(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    state = model.state_dict()
    torch.save({k: v for k, v in state.items() if k != "1.bias"}, tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="lack 1.bias"):
        load_weights(model, tmp_path / "missing.pt")
    torch.save({**state, "2.weight": torch.zeros(1)}, tmp_path / "extra.pt")
    with pytest.raises(CheckpointError, match="have tensors the model lacks: 2.weight"):
        load_weights(model, tmp_path / "extra.pt")
    torch.save({**state, "0.weight": torch.zeros(3, 5)}, tmp_path / "shape.pt")
    with pytest.raises(CheckpointError, match=r"0.weight is \(3, 5\) there, \(3, 4\) here"):
        load_weights(model, tmp_path / "shape.pt")
    with pytest.raises(CheckpointError, match="no weights in folder"):
        load_weights(model, tmp_path)


def test_a_metrics_file_plots_and_a_bad_line_is_named(tmp_path):
    good = tmp_path / "m.jsonl"
    good.write_text("".join(f'{{"step": {s}, "loss": {math.exp(-s)}, "lr": 0.1}}\n'
                            for s in range(1, 6)))
    plot_losses(read_jsonl(good), tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(ct.ChronotopeError, match="bad.jsonl:2 is not a JSON line"):
        read_jsonl(bad)


def test_a_resumed_runs_metrics_continue_without_repeating_steps(tmp_path):
    """A run stopped at step 5 with its last checkpoint at step 3 trains steps 4 and 5
    again: their old lines go, so the file has each step once, in order."""
    path = tmp_path / "metrics.jsonl"
    first = JsonlLog(path)
    for step in range(1, 6):
        first({"step": step, "loss": 1.0})
    first.close()
    again = JsonlLog(path)
    for step in (4, 5, 6):
        again({"step": step, "loss": 0.5})
    again.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in read_jsonl(path)][3:] == [0.5, 0.5, 0.5]
