"""The gallery (docs/schedules) as the tests load it: each test gets its primitives
registered afresh and leaves none behind."""

import sys
from pathlib import Path

import pytest

from chronotope.models import load_function
from chronotope.schedule import PRIMITIVES

GALLERY = Path(__file__).parents[2] / "docs" / "schedules"


@pytest.fixture
def gallery():
    """``gallery("file.py:fn")`` loads a gallery function; what it registers is undone."""
    sys.path.insert(0, str(GALLERY))
    before = dict(PRIMITIVES)
    try:
        yield lambda spec: load_function(f"{GALLERY / spec}")
    finally:
        sys.path.remove(str(GALLERY))
        for name in ("megatron_block", "gpt_sequence"):  # importing them registers it
            sys.modules.pop(name, None)
        PRIMITIVES.clear()
        PRIMITIVES.update(before)
