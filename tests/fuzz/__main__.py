"""``python -m tests.fuzz``: draw, train and compare the plans; print the table."""

import sys

from tests.fuzz.trials import main

sys.exit(main())
