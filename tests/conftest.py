"""Fixtures several test folders share."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run hundreds of small ops: extra threads only add contention on a busy
    machine. Modules that train many tiny models use it for every test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
