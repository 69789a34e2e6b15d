"""Python's cycle collector paused while a large plan is checked, compiled or written out.

Checking and compiling make hundreds of thousands of small objects (pieces, masks,
instructions) and free few of them: each of the collector's full passes walks them
all, and at a thousand ranks those passes take a third of the time. None of these
objects needs the collector (they form no cycles that outlive the call), so it waits
until the call returns.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
