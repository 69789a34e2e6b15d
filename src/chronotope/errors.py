"""Exceptions users can act on: one class per kind of mistake."""

from __future__ import annotations


class ChronotopeError(Exception):
    """Base class of every error chronotope raises on purpose."""


class CaptureError(ChronotopeError):
    """A model could not be turned into a graph (untraceable code, wrong inputs)."""


class UnknownModelError(ChronotopeError, KeyError):
    """A model name that is neither a built-in nor ``path/to/file.py:factory``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SignatureError(ChronotopeError):
    """An op signature string that does not parse or does not fit the op's tensors."""


class ModelLoadError(ChronotopeError):
    """A ``path/to/file.py:factory`` model spec that cannot be loaded or returns the wrong thing."""


class PlanError(ChronotopeError):
    """A plan that cannot work as written: a bad split, a device out of range, a bad order."""


class ScheduleError(PlanError):
    """A module schedule step that cannot apply; the message names the module and the fix."""


class UnassignedOpError(PlanError):
    """Some ops of the plan were never placed on a device."""


class DeadlockError(PlanError):
    """The plan's data dependencies and orders form a cycle: its ops would wait forever."""
