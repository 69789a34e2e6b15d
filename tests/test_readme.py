"""The README's and docs/' examples run as written: Python snippets and shell commands."""

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_examples_run():
    """As one script run with ``python``: what starts worker processes stands under the
    ``__main__`` guard a script needs."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    scope: dict = {"__name__": "__main__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for block in blocks:
            exec(compile(block, str(README), "exec"), scope)
    assert scope["plan"].world_size == 1024


def test_the_docs_python_examples_run(tmp_path, monkeypatch):
    """Each page of docs/ as one script, in a scratch folder (they write their pictures)."""
    pages = sorted((README.parent / "docs").rglob("*.md"))
    monkeypatch.chdir(tmp_path)
    ran = 0
    for page in pages:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
        scope: dict = {"__name__": "__main__"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for block in blocks:
                exec(compile(block, str(page), "exec"), scope)
                ran += 1
    assert ran


ROOT = README.parent
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def shell_blocks() -> list[tuple[str, str]]:
    """Each ``bash`` block of the README and docs/, named by its page and line."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"```bash\n(.*?)```", text, re.S):
            line = text[:match.start()].count("\n") + 1
            blocks.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


def runnable(block: str) -> str:
    """The block as bash runs it here, inside this test run: ``python -m pytest`` is this
    run, and of the install line the command after its ``pip install`` steps (CI's
    ``.ci/run`` installs exactly so)."""
    lines = []
    for line in block.splitlines():
        if line.strip().startswith("python -m pytest"):
            continue
        if line.startswith("pip install"):
            line = line.split("&&")[-1].strip()
        lines.append(line)
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("where,block", shell_blocks(), ids=[w for w, _ in shell_blocks()])
def test_every_shell_command_runs_as_written(where, block, tmp_path):
    """In a scratch copy of examples/ and docs/ (with tests/ for the zoo's models), so a
    command's files land there, with this environment's ``chronotope`` and ``python``."""
    for folder in ("examples", "docs"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                                 f"{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", runnable(block)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{where} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_shell_examples_are_found():
    """Every ``chronotope`` line of the README is in a block the test above runs."""
    commands = [line for _, block in shell_blocks() for line in block.splitlines()
                if line.lstrip().startswith("chronotope ")]
    assert len(commands) >= 30 and any("--constrain" in c for c in commands)
