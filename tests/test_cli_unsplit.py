"""``plan`` and ``run`` name the ops a batch-splitting policy could not split along the batch
(every rank then runs them on the whole batch); ``plan --json`` counts them."""

import json
import textwrap

import pytest

from chronotope.cli import main

MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 4), nn.Linear(4, 1)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            weights = torch.softmax(h, dim=0)  # over the batch: its dim cannot split
            g = torch.special.erfcx(h)  # no signature
            return self.b(g * weights).square().mean()

    def make():
        return Net(), torch.randn(4, 6)
""")


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "unsigned.py"
    path.write_text(MODEL)
    return f"{path}:make"


def test_plan_json_counts_and_names_the_ops_left_whole(model, capsys):
    assert main(["plan", model, "--devices", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["replicate_only_ops"] == 2
    assert "2 ops cannot split along the batch" in err
    assert "special_erfcx: no signature" in err
    assert "softmax: its signature cannot split that dim" in err


def test_plan_says_nothing_when_every_op_splits(capsys):
    assert main(["plan", "gpt", "--devices", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["replicate_only_ops"] == 0
    assert "cannot split" not in err


def test_tensor_parallel_asks_no_batch_split(model, capsys):
    assert main(["plan", model, "--devices", "2", "--policy", "tp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replicate_only_ops"] == 0


@pytest.mark.slow
def test_run_warns_and_still_trains_like_one_device(model, capsys):
    assert main(["run", model, "--devices", "2", "--steps", "1", "--check"]) == 0
    out = capsys.readouterr().out
    assert "cannot split along the batch" in out and "special_erfcx" in out
    assert "(match)" in out
