"""examples/shakespeare: dp on 2 gloo processes ends at the weights of a plain PyTorch loop.

The plain loop is what a user writes without chronotope: the same model from
``char_gpt``, the same ``DataLoader`` from ``batches()`` (read with torch's generator
seeded as every rank seeds it), the same AdamW groups, schedule and clipping from
``Optim``. dp's ranks each run half of every batch and all-reduce the gradients, so
the only difference allowed is float32 rounding of the same sums in another order.
"""

import sys
from pathlib import Path

import pytest
import torch

import chronotope as ct
from chronotope.models import load_function, load_workload
from chronotope.runtime.data import DataRandom
from chronotope.runtime.local import RunResult
from chronotope.runtime.optim import Optim
from chronotope.runtime.reference import compare
from chronotope.runtime.train import train

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "shakespeare"
MODEL = f"{EXAMPLE / 'model.py'}:char_gpt"
DATA = f"{EXAMPLE / 'data.py'}:batches"
VALIDATION = f"{EXAMPLE / 'data.py'}:validation"
STEPS = 8
SEED = 3
OPTIM = Optim("adamw", lr=1e-3, weight_decay=0.1, clip=1.0, schedule="cosine", warmup=3,
              min_lr=1e-4)
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def forget_data_module():
    """model.py imports its sibling data.py as ``data``: another example's ``data`` must
    not find this one in ``sys.modules``."""
    yield
    module = sys.modules.get("data")
    if module is not None and Path(getattr(module, "__file__", "")).parent == EXAMPLE:
        del sys.modules["data"]


def plain_pytorch(steps: int, optim: Optim, seed: int) -> RunResult:
    """The example trained by hand, on one device."""
    model = load_workload(MODEL, seed=seed).model
    data = DataRandom(seed)  # the generators every rank reads its data with
    with data:
        loader = iter(load_function(DATA)())
    opt = optim.build(model.parameters())
    rates = optim.scheduler(opt, steps)
    losses = []
    for _ in range(steps):
        with data:
            idx, targets = next(loader)
        opt.zero_grad(set_to_none=True)
        loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip)
        opt.step()
        rates.step()
        losses.append(loss.item())
    return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def validation_loss(params: dict[str, torch.Tensor], batches: int) -> float:
    """The mean loss of the held-out text's first batches under ``params``, in eval mode."""
    model = load_workload(MODEL, seed=SEED).model
    model.load_state_dict(params, strict=False)  # lm_head shares wte's weight
    model.eval()
    with torch.no_grad():
        losses = [float(model(idx, targets)) for (idx, targets), _ in
                  zip(load_function(VALIDATION)(), range(batches))]
    return sum(losses) / len(losses)


def test_dp_on_two_processes_matches_plain_pytorch():
    """The validation loss too: the held-out batches in eval mode under the final weights."""
    workload = load_workload(MODEL, seed=SEED)
    program = ct.compile(ct.policies.mesh(ct.capture(workload.model, workload.inputs), dp=2))
    run = train(program, workload, DATA, STEPS, OPTIM, seed=SEED, timeout=30.0,
                eval_data=VALIDATION, eval_batches=3)
    reference = plain_pytorch(STEPS, OPTIM, SEED)
    assert run.records[-1]["eval_loss"] == pytest.approx(
        validation_loss(reference.params, 3), rel=TOLERANCE)

    difference = compare(run, reference)
    print(f"\nshakespeare dp=2 vs plain PyTorch after {STEPS} steps: {difference}")
    assert difference.max_loss_rel_diff <= TOLERANCE, (run.losses, reference.losses)
    assert difference.max_param_rel_diff <= TOLERANCE
    assert reference.losses[-1] < reference.losses[0]  # it learns, from batches that differ
