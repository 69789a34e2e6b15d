"""A user's model file, loaded by the tests as ``tests/models/user_model.py:<factory>``.

One factory per return form ``load_workload`` accepts, plus some that are wrong.
"""

import torch
import torch.nn.functional as F
from torch import nn

from chronotope.models import Workload


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x, y=None):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out if y is None else F.mse_loss(out, y)


def make():
    """The plainest form: no keywords taken, a model and one input tensor."""
    return Regressor(), torch.randn(3, 4)


def make_args(device, seed):
    """Takes device and seed (no batch_size); inputs as a tuple of arguments."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)
    return Regressor().to(device), (x.to(device), y.to(device))


def make_kwargs(**options):
    """Takes everything; inputs as keyword arguments."""
    b = options.get("batch_size") or 2
    return Regressor(), {"x": torch.randn(b, 4), "y": torch.randn(b, 1)}


def make_loss_fn(batch_size=5):
    """A loss function as the third item; the model returns its raw output."""
    y = torch.randn(batch_size, 1)
    return Regressor(), torch.randn(batch_size, 4), lambda out: F.mse_loss(out, y)


def make_workload(*, device="cpu", batch_size=None, seed=0):
    torch.manual_seed(seed)
    b = batch_size or 2
    with torch.device(device):
        return Workload(Regressor(), (torch.randn(b, 4), torch.randn(b, 1)))


def broken():
    raise ValueError("no weights for this size")


def wrong_type():
    return 42


def wrong_model():
    return "not a module", torch.randn(3, 4)


def wrong_inputs():
    return Regressor(), 3.5


NOT_A_FUNCTION = 7
