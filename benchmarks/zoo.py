"""The model zoo (tests/zoo) under dp, tp, zero-3, 1f1b and folded 1f1b on two ranks: a
family x policy table of the largest relative differences from one device, and of what
fails and where.

    python benchmarks/zoo.py [--families opt vit] [--policies dp 1f1b] [--transport gloo] [--json]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests.zoo package

from tests.zoo.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
