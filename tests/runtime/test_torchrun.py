"""``chronotope train`` under torchrun: one rank per process, on one node or several, and
the same command both starts a run and restarts it from its last complete checkpoint."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chronotope.cli import main
from chronotope.runtime.launch import free_port
from chronotope.runtime.metrics import read_jsonl

pytestmark = pytest.mark.slow

DATA = f"{Path(__file__).parent / 'train_data.py'}:paced"


def node(rank: int, port: int, *argv: str, cwd: Path | None = None) -> subprocess.Popen:
    """One "node" of a two-node job on this machine: a torchrun agent with one rank."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
         str(rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
         str(port), "-m", "chronotope", "train", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
        # the threads chronotope's own workers take (rounding follows the thread count)
        env={**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))})


def test_two_nodes_killed_midway_and_restarted_by_the_same_commands_train_as_one_run(
        tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "steps.jsonl"
    argv = ("gpt", "--steps", "8", "--data", DATA, "--save", str(ck), "--save-every", "2",
            "--metrics", str(metrics), "--timeout", "30")
    port = free_port()
    first = [node(0, port, *argv), node(1, port, *argv)]
    deadline = time.monotonic() + 180
    while not (ck / "step-00000004" / ".metadata").is_file():
        assert time.monotonic() < deadline and all(p.poll() is None for p in first), \
            [p.communicate()[0] for p in first]
        time.sleep(0.1)
    os.kill(first[1].pid, signal.SIGKILL)  # node 1's agent: its rank goes with it
    assert first[0].wait(timeout=120) != 0  # node 0's rank finds its peer gone and stops
    first[1].wait()
    assert (ck / "step-00000004").is_dir() and not (ck / "step-00000008").exists()

    port = free_port()
    again = [node(0, port, *argv), node(1, port, *argv)]
    outs = [p.communicate(timeout=300)[0] for p in again]
    assert [p.returncode for p in again] == [0, 0], outs
    assert "continuing from" in outs[0] and "step 8/8" in outs[0]
    assert "step 8/8" not in outs[1]  # rank 0 alone reports
    restarted = {r["step"]: r["loss"] for r in read_jsonl(metrics)}

    whole = tmp_path / "whole.jsonl"  # the same run, never stopped, in one process tree
    assert main(["train", "gpt", "--devices", "2", "--steps", "8", "--data", DATA,
                 "--metrics", str(whole)]) == 0
    assert [restarted[s] for s in range(1, 9)] == [r["loss"] for r in read_jsonl(whole)]


def test_a_save_folder_the_nodes_do_not_share_is_refused_before_any_step(tmp_path):
    # each "node" saves into ./ck of its own working directory: node-local disks
    port = free_port()
    homes = [tmp_path / "node0", tmp_path / "node1"]
    for home in homes:
        home.mkdir()
    nodes = [node(r, port, "gpt", "--steps", "2", "--save", "ck", "--timeout", "30",
                  cwd=homes[r]) for r in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in nodes]
    assert all(p.returncode != 0 for p in nodes), outs
    assert "is not on storage every node sees: rank 1 on " in outs[0], outs[0]
    assert not [p for home in homes for p in home.glob("ck/step-*")]
