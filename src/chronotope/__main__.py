"""``python -m chronotope``: the command line, as torchrun starts it (``torchrun ... -m
chronotope train ...``)."""

import sys

from chronotope.cli import main

if __name__ == "__main__":
    sys.exit(main())
