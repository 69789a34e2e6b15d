"""Training for real on gloo processes: data, checkpoints, resume under other plans, faults."""

import copy
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import chronotope as ct
from chronotope.cli import main
from chronotope.graph.rng import CounterRandom, Stream
from chronotope.models import get_workload, load_function
from chronotope.policies import mesh, pipeline
from chronotope.runtime import checkpoint
from chronotope.runtime.data import DataRandom
from chronotope.runtime.launch import WorkerError, free_port
from chronotope.runtime.precision import BF16_TOLERANCE, Precision
from chronotope.runtime.train import train

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
DATA = f"{HERE / 'train_data.py'}"
OPTIM = ct.Optim("adamw", 1e-3, weight_decay=0.1, clip=1.0, schedule="cosine", warmup=2)


def gpt(dropout: float = 0.1):
    w = get_workload("gpt", dropout=dropout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


def plain_pytorch(w, data, steps, optim, accumulate=1, seed=0):
    """What a user writes on one device: same model, same batches, same optimizer."""
    tokens = load_function(f"{DATA}:{data}")
    model = copy.deepcopy(w.model)
    opt = optim.build(model.parameters())
    rates = optim.scheduler(opt, steps)
    rng, it, read, losses = DataRandom(seed), None, 0, []

    def next_batch():
        nonlocal it
        with rng:
            for _ in range(2):
                if it is None:
                    it = iter(tokens())
                try:
                    return next(it)
                except StopIteration:
                    it = None
        raise AssertionError

    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for _ in range(accumulate):
            x, y = next_batch()
            with CounterRandom(Stream(seed, read)):
                loss = model(x, y)
            read += 1
            (loss / accumulate).backward()
            total += float(loss.detach()) / accumulate
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip)
        opt.step()
        rates.step()
        losses.append(total)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def largest_difference(a: dict, b: dict) -> float:
    scale = max(float(t.abs().max()) for t in b.values())
    return max(float((a[n] - b[n]).abs().max()) for n in b) / scale


def test_training_on_a_data_loader_equals_plain_pytorch():
    w, graph = gpt()
    run = train(ct.compile(mesh(graph, dp=2)), w, f"{DATA}:tokens", 6, OPTIM, accumulate=2)
    losses, params = plain_pytorch(w, "tokens", 6, OPTIM, accumulate=2)
    assert run.losses == pytest.approx(losses, rel=1e-5)
    assert largest_difference(run.params, params) <= 1e-5
    assert [r["step"] for r in run.records] == [1, 2, 3, 4, 5, 6]
    assert run.records[0]["lr"] == pytest.approx(OPTIM.lr / 2)  # warmup
    assert run.records[0]["tokens_per_s"] > 0


def test_resuming_is_bitwise_and_works_under_other_plans_and_device_counts(tmp_path):
    w, graph = gpt()
    full = train(ct.compile(mesh(graph, dp=2)), w, f"{DATA}:tokens", 6, OPTIM,
                 save=str(tmp_path / "dp"), save_every=3)
    assert sorted(p.name for p in (tmp_path / "dp").iterdir()) == \
        ["latest", "step-00000003", "step-00000006"]
    same = train(ct.compile(mesh(graph, dp=2)), w, f"{DATA}:tokens", 6, OPTIM,
                 resume=str(tmp_path / "dp" / "step-00000003"))
    assert same.losses == full.losses[3:]  # bitwise: fp32 on CPU
    assert all(torch.equal(same.params[n], p) for n, p in full.params.items())
    for plan in (mesh(graph, tp=4), pipeline(graph, 2, 2, "1f1b")):
        other = train(ct.compile(plan), w, f"{DATA}:tokens", 6, OPTIM,
                      resume=str(tmp_path / "dp" / "step-00000003"))
        assert other.losses == pytest.approx(full.losses[3:], rel=1e-5)
        assert largest_difference(other.params, full.params) <= 1e-5
    # and back: a pipeline's checkpoint continues data parallel
    piped = train(ct.compile(pipeline(graph, 2, 2, "1f1b")), w, f"{DATA}:tokens", 3, OPTIM,
                  save=str(tmp_path / "pp"))
    back = train(ct.compile(mesh(graph, dp=2)), w, f"{DATA}:tokens", 6, OPTIM,
                 resume=str(tmp_path / "pp"))
    assert piped.losses + back.losses == pytest.approx(full.losses, rel=1e-5)


def test_a_killed_worker_is_named_within_a_minute_and_the_run_resumes(tmp_path, monkeypatch):
    w, graph = gpt(dropout=0.0)
    program = ct.compile(mesh(graph, dp=2))
    marker = tmp_path / "kill"
    marker.touch()
    monkeypatch.setenv("KILL_AT", str(marker))
    start = time.monotonic()
    with pytest.raises(WorkerError, match="worker rank 1 died"):
        train(program, w, f"{DATA}:killing", 8, OPTIM, save=str(tmp_path / "ck"),
              save_every=2)
    assert time.monotonic() - start < 60
    assert checkpoint.latest(tmp_path / "ck").name == "step-00000004"
    resumed = train(program, w, f"{DATA}:killing", 8, OPTIM, save=str(tmp_path / "ck"),
                    save_every=2, resume=str(tmp_path / "ck"))
    whole = train(program, w, f"{DATA}:tokens", 8, OPTIM)
    assert resumed.losses == whole.losses[4:]
    assert checkpoint.latest(tmp_path / "ck").name == "step-00000008"


def test_export_gives_a_state_dict_that_loads_strict_with_tied_weights_and_buffers(tmp_path):
    w, graph = gpt()
    run = train(ct.compile(mesh(graph, tp=2)), w, f"{DATA}:tokens", 2, OPTIM,
                save=str(tmp_path / "ck"))
    for out in ("w.pt", "w.safetensors"):
        assert main(["export", str(tmp_path / "ck"), str(tmp_path / out)]) == 0
        state = load_file(tmp_path / out) if out.endswith("safetensors") else \
            torch.load(tmp_path / out)
        model = copy.deepcopy(w.model)
        model.load_state_dict(state, strict=True)
        assert torch.equal(state["lm_head.weight"], state["wte.weight"])  # tied: both names
        assert all(torch.equal(p.detach(), run.params[n]) for n, p in model.named_parameters())


class ConvNet(nn.Module):
    """conv -> batch norm -> relu -> pool -> linear: running statistics change every step."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), \
            nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3))
        return nn.functional.cross_entropy(self.head(h), y)


def torch_loaded(w, path):
    """A checkpoint in a plain model and optimizer, loaded as a user's script loads one:
    torch's state-dict API and ``dcp.load``."""
    model = copy.deepcopy(w.model)
    opt = OPTIM.build(model.parameters())
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming ... a single process"
        dcp.load(state, checkpoint_id=str(checkpoint.latest(path)))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    return model, opt


def test_a_checkpoint_loads_through_torchs_state_dict_api_with_tied_weights_and_optimizer(
        tmp_path):
    w, graph = gpt()
    run = train(ct.compile(mesh(graph, tp=2)), w, f"{DATA}:tokens", 2, OPTIM,
                save=str(tmp_path / "ck"))
    model, opt = torch_loaded(w, tmp_path / "ck")
    assert all(torch.equal(p.detach(), run.params[n]) for n, p in model.named_parameters())
    assert model.lm_head.weight is model.wte.weight  # tied, under both names
    adam = opt.state[model.wte.weight]
    assert int(adam["step"]) == 2 and float(adam["exp_avg_sq"].sum()) > 0
    rates = ct.Rates(OPTIM, 2)
    rates.advance()
    rates.advance()
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(rates.lr, 0.1),
                                                                        (rates.lr, 0.0)]


def test_checkpoints_other_programs_write_start_and_continue_a_run(tmp_path):
    """Written here with plain torch: torch's state-dict API under "model." and "optim."
    (FSDP2's layout), torchtitan's (its optimizer flattened under "optimizer.", its step
    in "train_state.step", in step-N folders) and a weights-only export (bare names)."""
    w, graph = gpt()
    program = ct.compile(mesh(graph, tp=2))
    train(program, w, f"{DATA}:tokens", 2, OPTIM, save=str(tmp_path / "ours"))
    model, opt = torch_loaded(w, tmp_path / "ours")  # the run so far, as a user's script has it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming ... a single process"
        dcp.save({"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=str(tmp_path / "torch"))
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        dcp.save({"model": get_model_state_dict(model),
                  "optimizer": get_optimizer_state_dict(model, opt, options=flat),
                  "train_state": {"step": torch.tensor(2, dtype=torch.int32)}},
                 checkpoint_id=str(tmp_path / "titan" / "step-2"))
        dcp.save(get_model_state_dict(model), checkpoint_id=str(tmp_path / "weights"))
    # torchtitan's continues the run as chronotope's own does: its weights, optimizer
    # state and step
    mine = train(program, w, f"{DATA}:tokens", 4, OPTIM, resume=str(tmp_path / "ours"))
    theirs = train(program, w, f"{DATA}:tokens", 4, OPTIM, resume=str(tmp_path / "titan"))
    assert len(theirs.losses) == 2 and theirs.losses == pytest.approx(mine.losses, rel=1e-6)
    # and each starts a run from its weights (step 0, a fresh optimizer)
    for source in ("torch", "titan", "weights"):
        started = copy.deepcopy(w.model)
        ct.load_weights(started, tmp_path / source)
        assert all(torch.equal(p, q) for p, q in zip(started.state_dict().values(),
                                                     model.state_dict().values())), source
    assert main(["train", "gpt", "--devices", "2", "--steps", "1", "--init",
                 str(tmp_path / "weights")]) == 0
    # FSDP2's own: fully_shard, a step, dcp.save (in a process of its own: a gloo group)
    done = subprocess.run([sys.executable, str(HERE / "fsdp2_checkpoint.py"), str(tmp_path),
                           str(free_port())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    started = get_workload("gpt").model
    ct.load_weights(started, tmp_path / "fsdp2")
    whole = torch.load(tmp_path / "whole.pt")
    assert all(torch.equal(whole[n], t) for n, t in started.state_dict().items() if n in whole)
    assert main(["train", "gpt", "--devices", "2", "--steps", "1", "--optimizer", "AdamW",
                 "--lr", "1e-3", "--resume", str(tmp_path / "fsdp2")]) == 0


def test_batch_norm_statistics_are_checkpointed_and_exported(tmp_path):
    torch.manual_seed(0)
    w = ct.Workload(ConvNet(), (torch.randn(8, 3, 6, 6), torch.randint(0, 5, (8,))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    run = train(ct.compile(mesh(graph, dp=2)), w, [w.inputs], 2, save=str(tmp_path / "ck"))
    state = checkpoint.consolidate(tmp_path / "ck")
    model = copy.deepcopy(w.model)
    model.load_state_dict(state, strict=True)
    assert not torch.equal(model.norm.running_mean, w.model.norm.running_mean)  # it trained
    for name, b in model.named_buffers():
        if name in run.buffers:
            assert torch.equal(b, run.buffers[name]), name
    assert all(torch.equal(p.detach(), run.params[n]) for n, p in model.named_parameters())


class CountsAndSkips(nn.Module):
    """A counter buffer forward adds one to, and a head forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.unused = nn.Linear(6, 3), nn.Linear(3, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return nn.functional.cross_entropy(self.body(x), y)


def test_unused_parameters_and_counters_are_checkpointed_and_exported_as_trained(tmp_path):
    torch.manual_seed(0)
    w = ct.Workload(CountsAndSkips(), (torch.randn(8, 6), torch.randint(0, 3, (8,))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    train(ct.compile(pipeline(graph, 2, 2, "1f1b")), w, [w.inputs], 3, OPTIM,
          save=str(tmp_path / "ck"))
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "w.pt")]) == 0
    model = copy.deepcopy(w.model)
    model.load_state_dict(torch.load(tmp_path / "w.pt"), strict=True)
    assert int(model.steps) == 3  # once a step, not once per micro-batch
    assert torch.equal(model.unused.weight, w.model.unused.weight)  # no decay, no update
    assert not torch.equal(model.body.weight, w.model.body.weight)


def cli(*argv, capsys):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_line_trains_streams_records_saves_exports_and_plots(tmp_path, capsys):
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    code, out, _ = cli("train", "gpt", "--devices", "2", "--steps", "3", "--data",
                       f"{DATA}:tokens", "--optimizer", "adamw", "--lr", "1e-3", "--save",
                       str(ck), "--metrics", str(metrics), "--json", capsys=capsys)
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [r["step"] for r in lines[:3]] == [1, 2, 3] and lines[3]["steps"] == 3
    assert [json.loads(line)["loss"] for line in metrics.read_text().splitlines()] == \
        [r["loss"] for r in lines[:3]]
    assert lines[3]["checkpoint"].endswith("step-00000003")
    code, _, _ = cli("plot", str(metrics), "--out", str(tmp_path / "loss.png"), capsys=capsys)
    assert code == 0 and (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # a second run continues it: steps 4 and 5, from the checkpoint of step 3
    code, out, _ = cli("train", "gpt", "--devices", "2", "--policy", "tp", "--steps", "5",
                       "--data", f"{DATA}:tokens", "--optimizer", "adamw", "--lr", "1e-3",
                       "--save", str(ck), "--resume", str(ck), "--json", capsys=capsys)
    assert code == 0 and [json.loads(x).get("step") for x in out.splitlines()][:2] == [4, 5]


def test_a_log_file_gets_each_phase_as_it_starts_and_a_line_every_k_steps(capsys):
    """Under nohup or a batch scheduler stdout is a file: no progress bar, but lines."""
    code, out, _ = cli("train", "gpt", "--devices", "2", "--steps", "5", "--log-every", "2",
                       capsys=capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0] == "loading gpt ...", out
    assert "capturing, planning (dp) and compiling ..." in lines
    assert "starting 2 workers ..." in lines
    assert [x.split(":")[0] for x in lines if x.startswith("step ")] == \
        ["step 1/5", "step 2/5", "step 4/5", "step 5/5"]


def test_training_starts_from_given_weights(tmp_path, capsys):
    other, batch = get_workload("gpt", seed=1), get_workload("gpt").inputs
    torch.save(other.model.state_dict(), tmp_path / "init.pt")
    code, out, _ = cli("train", "gpt", "--devices", "2", "--steps", "1", "--init",
                       str(tmp_path / "init.pt"), "--json", capsys=capsys)
    first = json.loads(out.splitlines()[0])["loss"]
    with torch.no_grad():
        expected = float(other.model(*batch))
    assert code == 0 and first == pytest.approx(expected, rel=1e-5)


def test_bad_input_is_named_with_exit_code_2_and_nothing_is_overwritten(tmp_path, capsys):
    base = ["train", "gpt", "--devices", "2", "--steps", "2"]
    code, _, err = cli(*base, "--data", f"{DATA}:ragged", "--steps", "17", capsys=capsys)
    assert code == 2 and "'idx' is (2, 32) int64" in err and "drop_last=True" in err
    code, _, err = cli(*base, "--data", f"{DATA}:per_rank", capsys=capsys)
    assert code == 2 and "batch 0 on rank 1 differs from rank 0's" in err

    ck = tmp_path / "ck"
    assert cli(*base, "--save", str(ck), capsys=capsys)[0] == 0
    before = {p: p.stat().st_mtime_ns for p in ck.rglob("*")}
    code, _, err = cli("train", "llama", "--devices", "2", "--steps", "3", "--resume", str(ck),
                       "--save", str(ck), capsys=capsys)
    assert code == 2 and "is of another model" in err
    code, out, _ = cli(*base, "--save", str(ck), capsys=capsys)  # started again when done
    assert code == 0 and "nothing left to do" in out
    assert {p: p.stat().st_mtime_ns for p in ck.rglob("*")} == before

    (ck / "step-00000002" / "__1_0.distcp").unlink()
    code, _, err = cli(*base, "--steps", "3", "--resume", str(ck), capsys=capsys)
    assert code == 2 and "missing __1_0.distcp" in err


def test_a_run_killed_while_saving_leaves_the_last_checkpoint_in_use(tmp_path):
    w, graph = gpt(dropout=0.0)
    program = ct.compile(mesh(graph, dp=2))
    first = train(program, w, f"{DATA}:tokens", 2, save=str(tmp_path))
    partial = tmp_path / "step-00000003.incomplete"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(os.urandom(64))  # what a killed save leaves
    assert checkpoint.latest(tmp_path).name == "step-00000002"
    after = train(program, w, f"{DATA}:tokens", 3, save=str(tmp_path), resume=str(tmp_path))
    whole = train(program, w, f"{DATA}:tokens", 3)
    assert first.losses + after.losses == whole.losses


OPTIM_ARGS = ("--optimizer", "adamw", "--lr", "1e-3", "--weight-decay", "0.1", "--clip", "1.0",
              "--lr-schedule", "cosine", "--warmup", "2")  # OPTIM, as options


def test_the_torchrun_launcher_trains_with_trains_options_from_its_weights_or_given_ones(
        tmp_path):
    w, graph = gpt(dropout=0.0)
    program = ct.compile(mesh(graph, tp=2))
    ct.save(program, w, str(tmp_path), steps=2)
    # what the ranks need besides their code holds no weights: those are a checkpoint
    saved = torch.load(tmp_path / "program.pt", weights_only=False)
    assert {t.device.type for spec in saved["specs"] for t in spec.params.values()} == {"meta"}
    assert checkpoint.latest(tmp_path / "init").name == "step-00000000"
    src = os.path.dirname(os.path.dirname(ct.__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}

    def launch(*argv):
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(tmp_path / "launch.py"), "--data", f"{DATA}:tokens", *argv],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)

    done = launch("--steps", "3", "--metrics", str(tmp_path / "m.jsonl"), *OPTIM_ARGS)
    assert done.returncode == 0, done.stderr[-2000:]
    here = train(program, w, f"{DATA}:tokens", 3, OPTIM)
    logged = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").open()]
    assert logged == pytest.approx(here.losses, rel=1e-6)
    weights = checkpoint.consolidate(tmp_path / "checkpoints")
    assert largest_difference({n: weights[n] for n in here.params}, here.params) <= 1e-6
    # from another run's weights: a checkpoint, or a state-dict file
    assert main(["export", str(tmp_path / "checkpoints"), str(tmp_path / "w.pt")]) == 0
    started = copy.deepcopy(w.model)
    started.load_state_dict(torch.load(tmp_path / "w.pt"))
    there = train(program, dataclasses.replace(w, model=started), f"{DATA}:tokens", 2)
    for init in ("checkpoints", "w.pt"):
        done = launch("--steps", "2", "--init", init, "--save", f"from-{init}")
        assert done.returncode == 0, done.stderr[-2000:]
        losses = [float(line.split()[-1]) for line in done.stdout.splitlines()
                  if line.startswith("step ")]
        assert losses == pytest.approx(there.losses, rel=1e-6), init
    # a folder another live run holds is refused on every rank, naming that run
    lease = {"host": socket.gethostname(), "pid": os.getpid()}
    (tmp_path / "checkpoints" / checkpoint.LEASE).write_text(json.dumps(lease))
    held = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(tmp_path / "launch.py"), "--data", f"{DATA}:tokens", "--steps", "4"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert held.returncode != 0
    assert f"is in use by a run on {lease['host']} (pid {os.getpid()})" in \
        held.stdout + held.stderr


def test_tensorboard_logs_the_steps_or_says_how_to_get_it(tmp_path, capsys):
    code, _, err = cli("train", "gpt", "--devices", "2", "--steps", "2", "--tensorboard",
                       str(tmp_path / "tb"), capsys=capsys)
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert code == 2 and "pip install tensorboard" in err
    else:
        assert code == 0 and any((tmp_path / "tb").iterdir())


def test_fp16_training_skips_overflowing_steps_and_resumes_bitwise_with_its_loss_scale(tmp_path):
    w, graph = gpt(dropout=0.0)
    program = ct.compile(mesh(graph, dp=2))
    fp16 = Precision("fp16", init_scale=2.0 ** 20)  # overflows at first: skipped, scaled down
    full = train(program, w, f"{DATA}:tokens", 6, OPTIM, save=str(tmp_path), save_every=3,
                 precision=fp16)
    assert full.records[0]["skipped"] and full.records[0]["loss_scale"] == 2.0 ** 19
    assert not full.records[-1]["skipped"]
    assert all(t.dtype == torch.float32 for t in full.params.values())  # fp32 masters
    resumed = train(program, w, f"{DATA}:tokens", 6, OPTIM, precision=fp16,
                    resume=str(tmp_path / "step-00000003"))
    assert resumed.losses == full.losses[3:]
    assert [r["loss_scale"] for r in resumed.records] == \
        [r["loss_scale"] for r in full.records[3:]]


def test_run_check_in_bf16_compares_with_one_device_under_the_same_autocast(capsys):
    code, out, _ = cli("run", "gpt", "--devices", "2", "--steps", "3", "--check", "--dtype",
                       "bf16", "--json", capsys=capsys)
    report = json.loads(out)
    assert code == 0 and report["match"] and report["tolerance"] == BF16_TOLERANCE
    assert 0 < report["max_param_rel_diff"] <= BF16_TOLERANCE


SCATTER = '''
import torch
from torch import nn


class Scatter(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, idx):  # a bf16 linear output added into an fp32 buffer: refused
        return torch.zeros(4, 8).index_add(0, idx, self.proj(x)).square().mean()


def make():
    return Scatter(), (torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))
'''


def test_a_dtype_an_op_cannot_run_in_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "scatter.py").write_text(SCATTER)
    code, _, err = cli("train", f"{tmp_path / 'scatter.py'}:make", "--devices", "2",
                       "--dtype", "bf16", "--save", str(tmp_path / "ck"), capsys=capsys)
    assert code == 2 and "op index_add" in err and "cannot run in bf16" in err
    assert not (tmp_path / "ck").exists()


def test_resuming_with_another_optimizer_starts_it_afresh_and_says_so(tmp_path):
    w, graph = gpt(dropout=0.0)
    program = ct.compile(mesh(graph, dp=2))
    train(program, w, f"{DATA}:tokens", 2, ct.Optim("sgd", 0.1, momentum=0.9),
          save=str(tmp_path))
    with pytest.warns(UserWarning, match="trained with sgd, this run uses adamw"):
        resumed = train(program, w, f"{DATA}:tokens", 4, OPTIM, resume=str(tmp_path))
    assert len(resumed.losses) == 2 and all(math.isfinite(x) for x in resumed.losses)


@pytest.mark.parametrize("shard", [False, True], ids=["", "optimizer-sharded"])
def test_a_scaled_plan_trains_on_data_like_plain_pytorch_and_resumes_unscaled(tmp_path, shard):
    w, graph = gpt(dropout=0.0)  # the data's batch of 4: two replicas of 2 rows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unit = ct.capture(get_workload("gpt", dropout=0.0, batch_size=2))
    # sharded: each replica keeps the Adam state of its run of every region, and writes it
    scaled = train(ct.compile(mesh(unit, tp=2).scale(2, shard_optimizer=shard)), w,
                   f"{DATA}:tokens", 4, OPTIM, save=str(tmp_path / "scaled"), save_every=2)
    losses, params = plain_pytorch(w, "tokens", 4, OPTIM)
    assert scaled.losses == pytest.approx(losses, rel=1e-5)
    assert largest_difference(scaled.params, params) <= 1e-5
    back = train(ct.compile(mesh(graph, dp=2)), w, f"{DATA}:tokens", 4, OPTIM,
                 resume=str(tmp_path / "scaled" / "step-00000002"))
    assert back.losses == pytest.approx(losses[2:], rel=1e-5)
    assert largest_difference(back.params, params) <= 1e-5


def test_any_optimizer_and_a_schedule_on_the_loss_resume_as_if_never_stopped(tmp_path):
    w, graph = gpt()
    # Adafactor keeps factored state (rows and columns), shaped unlike its parameter;
    # ReduceLROnPlateau steps on the loss (mode "max": a falling loss halves the rate)
    optim = ct.Optim("Adafactor", 1e-2, clip=1.0, schedule="ReduceLROnPlateau",
                     schedule_options={"mode": "max", "patience": 0, "factor": 0.5})
    program = ct.compile(mesh(graph, dp=2))
    whole = train(program, w, f"{DATA}:tokens", 4, optim)
    first = train(program, w, f"{DATA}:tokens", 2, optim, save=str(tmp_path / "ck"))
    rest = train(program, w, f"{DATA}:tokens", 4, optim, resume=str(tmp_path / "ck"))
    assert first.losses + rest.losses == whole.losses  # bitwise: fp32 on CPU
    assert all(torch.equal(rest.params[n], p) for n, p in whole.params.items())
    rates = [r["lr"] for r in whole.records]
    assert [r["lr"] for r in first.records + rest.records] == rates
    assert rates[-1] < rates[0]  # the schedule acted on the losses


def test_data_loader_workers_start_as_in_a_plain_script(tmp_path, monkeypatch):
    """Not by spawn, which the rank's own process was started by: spawn imports torch
    again in every loader worker, seconds before the first batch."""
    import multiprocessing

    monkeypatch.setenv("START_METHOD_AT", str(tmp_path / "method"))
    w, graph = gpt()
    run = train(ct.compile(mesh(graph, dp=2)), w, f"{DATA}:with_workers", 2, OPTIM)
    assert (tmp_path / "method").read_text() == multiprocessing.get_all_start_methods()[0]
    assert run.losses == pytest.approx(plain_pytorch(w, "tokens", 2, OPTIM)[0], rel=1e-5)


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_a_hugging_face_folder_trains_and_exports_as_one_from_pretrained_loads(tmp_path, name):
    from transformers import AutoModelForCausalLM

    get_workload(name).model.save_pretrained(tmp_path / "in")
    assert main(["train", str(tmp_path / "in"), "--devices", "2", "--steps", "2", "--save",
                 str(tmp_path / "ck")]) == 0
    out = tmp_path / "exported" / name  # folders made as needed
    assert main(["export", str(tmp_path / "ck"), str(out), "--hf",
                 "--max-shard-size", "100KB"]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    trained = AutoModelForCausalLM.from_pretrained(out)
    weights = checkpoint.consolidate(tmp_path / "ck")
    assert all(torch.equal(t, weights[n]) for n, t in trained.state_dict().items())
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "in")
    assert not all(torch.equal(a, b) for a, b in zip(start.state_dict().values(),
                                                      trained.state_dict().values()))
    # a config alone: the weights drawn at the seed; a model type's default config, planned
    assert main(["train", str(tmp_path / "in" / "config.json"), "--devices", "2", "--steps",
                 "1"]) == 0
    if name == "hf-gpt2":  # built on the meta device: no weights drawn
        assert main(["plan", "hf:gpt2", "--policy", "tp", "--devices", "4"]) == 0
    # a checkpoint of a model transformers does not know is refused, saying what to do
    assert main(["train", "gpt", "--devices", "2", "--steps", "1", "--save",
                 str(tmp_path / "gpt")]) == 0
    assert main(["export", str(tmp_path / "gpt"), str(tmp_path / "gpt-hf"), "--hf"]) == 2


def test_a_saved_programs_starting_weights_of_another_model_are_refused_naming_it(tmp_path):
    from chronotope.runtime.train import Job, _initial_weights

    w, graph = gpt()
    ct.save(ct.compile(mesh(graph, dp=2)), w, str(tmp_path))
    other = get_workload("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = Job.of(ct.compile(mesh(ct.capture(other), dp=2)), other)
    with pytest.raises(checkpoint.CheckpointError, match="is of another model"):
        _initial_weights(tmp_path / "init", job)
