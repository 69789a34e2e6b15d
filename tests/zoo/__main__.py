"""``python -m tests.zoo``: the family x policy table."""

import sys

from tests.zoo.harness import main

sys.exit(main())
