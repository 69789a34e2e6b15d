"""What every command pays before it works: the imports, and the code's own lint."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Half a second to a second each, and only searching, saving or DTensor interop use them.
ON_DEMAND = ("scipy", "torch.distributed.tensor", "torch.distributed.checkpoint")


def test_import_and_help_load_neither_scipy_nor_dtensor_nor_dcp():
    code = ("import sys, contextlib, io\n"
            "import chronotope\n"
            "from chronotope.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['--help']) == 0 and main(['train', '--help']) == 0\n"
            f"print([m for m in {ON_DEMAND!r} if m in sys.modules])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_the_runtime_names_load_when_used():
    code = ("import chronotope as ct, sys\n"
            "assert 'torch.distributed.checkpoint' not in sys.modules\n"
            "assert callable(ct.train) and callable(ct.load_weights)\n"
            "assert 'torch.distributed.checkpoint' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_ruff_finds_nothing():
    """Undefined names, unused imports and import order, as pyproject.toml configures."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
