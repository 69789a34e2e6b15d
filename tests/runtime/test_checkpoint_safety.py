"""A folder of checkpoints is one run's at a time, found writable before any work, keeps
the newest few when asked, and a damaged checkpoint is named by its file and passed over
for the sound one before it."""

import os
import socket
import subprocess
import sys
import warnings

import pytest

import chronotope as ct
from chronotope.cli import main
from chronotope.models import get_workload
from chronotope.policies import mesh
from chronotope.runtime import checkpoint
from chronotope.runtime.checkpoint import CheckpointError, lease
from chronotope.runtime.data import example_batches
from chronotope.runtime.train import train


def test_a_second_run_is_refused_naming_the_first_and_a_gone_one_is_taken_over(tmp_path):
    with lease(tmp_path / "ck"):
        with pytest.raises(CheckpointError, match=rf"in use by a run on {socket.gethostname()} "
                                                  rf"\(pid {os.getpid()}\)"):
            with lease(tmp_path / "ck"):
                pass
    assert not (tmp_path / "ck" / checkpoint.LEASE).exists()  # given back
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "ck" / checkpoint.LEASE).write_text(
        f'{{"host": "{socket.gethostname()}", "pid": {gone.pid}}}')
    with pytest.warns(UserWarning, match="held by a run that is gone"):
        with lease(tmp_path / "ck"):
            pass


def test_a_folder_that_cannot_be_written_is_named_before_any_work(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"cannot save checkpoints into .*file/ck"):
        with lease(tmp_path / "file" / "ck"):
            pass
    code = main(["train", "gpt", "--devices", "2", "--steps", "2", "--save",
                 str(tmp_path / "file" / "ck")])
    assert code == 2 and "cannot save checkpoints into" in capsys.readouterr().err


@pytest.mark.slow
def test_keep_leaves_the_newest_checkpoints_and_a_held_folder_is_not_written(tmp_path):
    w = get_workload("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = ct.compile(mesh(ct.capture(w), dp=2))
    ck = tmp_path / "ck"
    train(program, w, example_batches(w), 4, save=str(ck), save_every=1, keep=2)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000003", "step-00000004"]
    # a damaged file (same size, one byte changed) is named, and the step before it used
    shard = ck / "step-00000004" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"step-00000004.* is damaged: __1_0.distcp is not as "
                                         r"it was written.*continuing from .*step-00000003"):
        assert checkpoint.latest(ck) == ck / "step-00000003"
    (ck / "step-00000003" / ".metadata").write_bytes(b"\x80\x04")  # truncated
    with pytest.raises(CheckpointError, match="step-00000004.* is damaged: __1_0.distcp"):
        checkpoint.latest(ck)
    with pytest.raises(CheckpointError, match=r"step-00000003.* \.metadata cannot be read"):
        checkpoint.latest(ck / "step-00000003")
    with lease(tmp_path / "other"), pytest.raises(CheckpointError, match="in use"):
        train(program, w, example_batches(w), 2, save=str(tmp_path / "other"))
    assert not any((tmp_path / "other").iterdir())  # nothing written, the lease given back
