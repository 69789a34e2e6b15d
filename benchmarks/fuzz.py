"""Random plans (tests/fuzz) over thirteen model families: how many were accepted and trained
like one device, how many were refused and by which error, per family, and any failure
with the Python that makes its plan again.

    python benchmarks/fuzz.py [--plans 500] [--first 0] [--families gpt cnn] [--show] [--json]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests.fuzz package

from tests.fuzz.trials import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
