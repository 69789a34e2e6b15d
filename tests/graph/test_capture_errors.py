"""A model neither frontend can capture: the error is short and says why, and nothing
else floods the terminal (torch.export prints the partial graph of a failed export)."""

import inspect

import pytest
import torch
from torch import nn

import chronotope as ct

LAYERS = 40  # a partial graph of a few hundred lines


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(LAYERS)))

    def forward(self, x):
        y = self.layers(x)
        if y.sum() > 0:  # a branch on a tensor value: neither frontend can follow it
            y = y * 2
        return y.mean()


def test_the_error_is_a_few_lines_naming_both_reasons_and_the_line(capfd):
    line = inspect.getsourcelines(Deep.forward)[1] + 2
    with pytest.raises(ct.CaptureError) as err:
        ct.capture(Deep(), torch.randn(2, 8))
    message = str(err.value)
    assert len(message.splitlines()) <= 6, message
    assert f"test_capture_errors.py:{line}" in message
    assert "torch.fx failed: TraceError" in message
    assert "torch.export failed too: GuardOnDataDependentSymNode" in message
    assert "What to try" in message
    printed = capfd.readouterr()
    assert "def forward" not in printed.err + printed.out
    assert len((printed.err + printed.out).splitlines()) <= 2  # torch may log one warning


def test_export_alone_fails_the_same_way(capfd):
    with pytest.raises(ct.CaptureError) as err:
        ct.capture(Deep(), torch.randn(2, 8), frontend="export")
    message = str(err.value)
    assert len(message.splitlines()) <= 5, message
    assert "torch.export failed: GuardOnDataDependentSymNode" in message
    assert "test_capture_errors.py" in message and "What to try" in message
    printed = capfd.readouterr()
    assert "def forward" not in printed.err + printed.out


def test_a_successful_export_still_prints_what_it_prints(capfd):
    class Loud(nn.Module):
        def forward(self, x):
            import sys
            print("said on stderr", file=sys.stderr)
            return x.square().mean()

    ct.capture(Loud(), torch.randn(2, 3), frontend="export")
    assert "said on stderr" in capfd.readouterr().err


def test_a_model_already_parallelized_is_refused_in_one_line_saying_to_pass_it_unwrapped():
    import subprocess
    import sys
    from pathlib import Path

    from chronotope.runtime.launch import free_port

    done = subprocess.run([sys.executable, str(Path(__file__).parent / "wrapped_models.py"),
                           str(free_port())], capture_output=True, text=True, timeout=120)
    said = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert done.returncode == 0 and said.keys() == {"parallelize_module", "fully_shard", "DDP"}, \
        done.stderr[-2000:]
    for how in ("parallelize_module", "fully_shard"):
        assert f"as {how} makes it): pass the model as written for one device" in said[how]
    assert "pass the model inside it (its .module)" in said["DDP"]



class Mismatched(nn.Module):
    """A model whose op does not run on the example batch, its output then iterated: fx,
    without the shape that op would have made, stops there, with a complaint about the
    iteration that hides the op's."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        h = self.proj(x) + self.bias  # 8 features against 3
        return torch.stack([row.sum() for row in h]).mean()


@pytest.mark.parametrize("frontend", ["auto", "fx"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_op_that_fails_is_named_not_where_tracing_stopped_after_it(frontend, device):
    line = inspect.getsourcelines(Mismatched.forward)[1] + 1
    with pytest.raises(ct.CaptureError) as err:
        ct.capture(Mismatched().to(device), torch.randn(2, 8), frontend=frontend)
    message = str(err.value)
    assert message.startswith("Mismatched: add (add) at "), message
    assert f"test_capture_errors.py:{line}" in message
    assert "fails on inputs [float32[2, 8], float32[3]]" in message
    assert "Example batch: x float32[2, 8]" in message
    assert ("cannot be iterated" in message) == (frontend == "fx")  # fx's own words, after
