"""mypy over the whole package, against a baseline that only shrinks.

``tests/mypy-baseline.json`` holds, per module, the errors mypy still finds there; a
module it does not list must have none (``compile/`` and ``plan/`` among them). A count
above its baseline fails (new errors), and so does one below it (lower the baseline:
fixed errors stay fixed)."""

import collections
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
BASELINE = ROOT / "tests" / "mypy-baseline.json"
CLEAN = ("src/chronotope/compile/", "src/chronotope/plan/")


def errors_per_module() -> dict[str, int]:
    run = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary",
                          "--cache-dir", str(ROOT / ".mypy_cache")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    if run.returncode not in (0, 1) or "error: " not in run.stdout and run.returncode:
        raise AssertionError(f"mypy did not run:\n{run.stdout}\n{run.stderr}")
    found = re.findall(r"^(src/\S+\.py):\d+: error: ", run.stdout, re.M)
    return dict(sorted(collections.Counter(found).items()))


@pytest.mark.slow
def test_mypy_finds_no_more_errors_than_the_baseline_and_none_in_compile_and_plan():
    baseline = json.loads(BASELINE.read_text())
    found = errors_per_module()
    assert not [m for m in baseline if m.startswith(CLEAN)], "compile/ and plan/ stay clean"
    more = {m: (n, baseline.get(m, 0)) for m, n in found.items() if n > baseline.get(m, 0)}
    assert not more, ("mypy finds new errors (module: (found, baseline)): "
                      f"{more}; run `python -m mypy` and fix them")
    fewer = {m: (found.get(m, 0), n) for m, n in baseline.items() if found.get(m, 0) < n}
    assert not fewer, (f"fewer errors than the baseline (module: (found, baseline)): {fewer}; "
                       f"lower {BASELINE.name} to the found counts")
