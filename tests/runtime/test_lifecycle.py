"""A training run's processes live and die with it: a killed launcher leaves no worker
training on, and Ctrl-C or a scheduler's SIGTERM stops every rank after the same step,
saves it, and says so in one line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import chronotope as ct

SRC = os.path.dirname(os.path.dirname(ct.__file__))  # importable however it was installed


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (not zombies waiting for a parent that is gone)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """``chronotope train`` on 2 processes for far more steps than it will run, once its
    workers have taken two steps."""
    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "chronotope.cli", "train", "gpt", "--policy", "dp",
         "--devices", "2", "--steps", "100000", "--metrics", str(metrics), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)  # its own process group, as a terminal's job has
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no step within 180 s"
        time.sleep(0.2)
    return proc, metrics


def gone_within(pids: set[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pids)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "Ctrl-C to the job"])
def test_a_stopped_run_saves_its_step_and_leaves_no_process(tmp_path, how):
    save = tmp_path / "ckpt"
    proc, metrics = start(tmp_path, "--save", str(save))
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    signum = signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT
    if signum == signal.SIGTERM:
        proc.send_signal(signum)
    else:  # a terminal sends it to every process of the foreground job
        os.killpg(proc.pid, signum)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signum, err
    assert gone_within(workers, 10), alive(workers)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    last = steps[-1]
    assert f"interrupted at step {last}; last complete checkpoint step {last}" in err, err
    assert "Traceback" not in err, err
    assert (save / f"step-{last:08d}" / ".metadata").is_file()
    assert steps == list(range(1, last + 1))  # every rank stopped after the same step


@pytest.mark.slow
def test_workers_of_a_killed_launcher_exit(tmp_path):
    """SIGKILL leaves the launcher no chance to stop anything: its workers see it gone."""
    proc, _ = start(tmp_path)
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    proc.kill()
    proc.communicate(timeout=30)
    assert gone_within(workers, 10), alive(workers)
