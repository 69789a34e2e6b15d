"""The callables ops run, as references another process can follow.

A rank's spec travels to a worker process (pickled by ``spawn``, or saved for
``torchrun``), but what its ops call does not always pickle: aten ops (every op
captured through ``torch.export``) refuse to, and a function of the user's model
file lives in a module only this process has. A ``Target`` names where a worker
finds the callable again: a module and an attribute path in it, plus the file
the module came from, for modules a new process cannot import by name (the
user's file, loaded by its path as ``load_workload`` does).
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from chronotope.errors import ChronotopeError
from chronotope.models import import_file


class TargetError(ChronotopeError):
    """A process cannot find, or cannot be sent, the callable an op runs."""


@dataclass(frozen=True)
class Target:
    """Where a process finds the callable an op runs (pickles as three strings)."""

    module: str  # a module name: torch, torch.nn.functional, the user's file's private name
    path: str  # the attribute path in it: ops.aten.relu.default, my_op, Block.attention
    file: str | None = None  # where the module came from
    # A module to import first: the one registering a custom op (torch.library.custom_op),
    # which torch.ops knows only once it ran, as a Hugging Face MoE layer's grouped matmul.
    registers: str | None = None

    def __str__(self) -> str:
        return f"{self.path} of module {self.module}" + (f" ({self.file})" if self.file else "")

    def resolve(self, op: str) -> Callable[..., Any]:
        """The callable itself; importing its module, or loading its file, when needed."""
        try:
            if self.registers:
                importlib.import_module(self.registers)
            obj: Any = self._module()
            for part in self.path.split("."):
                obj = getattr(obj, part)
        except Exception as e:
            raise TargetError(f"op {op} runs {self}, which this process cannot load: "
                              f"{type(e).__name__}: {e}") from e
        return obj

    def _module(self) -> ModuleType:
        if self.module in sys.modules:
            return sys.modules[self.module]
        try:
            return importlib.import_module(self.module)
        except ModuleNotFoundError:
            if self.file is None:
                raise
        with torch.random.fork_rng(devices=[]):  # what the file draws leaves the run's stream
            return import_file(Path(self.file), self.module)


def reference(fn: Any) -> Target | None:
    """Where another process finds ``fn``: the first name that leads back to this very
    object, or None when none does (a lambda, a function defined inside a function)."""
    for module, path in _names(fn):
        found = sys.modules.get(module)
        for part in path.split("."):
            found = getattr(found, part, None)
        if found is fn or (inspect.ismethod(fn) and found == fn):  # a class's method, made anew
            return Target(module, path, getattr(sys.modules[module], "__file__", None),
                          _registering_module(fn))
    return None


def _registering_module(fn: Any) -> str | None:
    """The module whose import registers ``fn``, a custom op; None for torch's own ops."""
    if not isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    from torch._library.custom_ops import OPDEFS

    name = fn._schema.name if isinstance(fn, torch._ops.OpOverload) else fn._qualified_op_name
    opdef = OPDEFS.get(name)
    init = getattr(opdef, "_init_fn", None)
    return getattr(init, "__module__", None)


def _names(fn: Any) -> list[tuple[str, str]]:
    """Candidate (module, attribute path) pairs naming ``fn``."""
    if isinstance(fn, torch._ops.OpOverload):
        return [("torch", f"ops.{fn.namespace}.{fn._opname}.{fn._overloadname}")]
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return [("torch", "ops." + fn._qualified_op_name.replace("::", "."))]
    if isinstance(fn, torch._ops.HigherOrderOperator):
        return [("torch", f"ops.{fn.namespace}.{fn.name()}")]
    owner = getattr(fn, "__self__", None)
    if inspect.ismethod(fn) and isinstance(owner, type):  # a classmethod: Function.apply
        return [(owner.__module__, f"{owner.__qualname__}.{fn.__name__}")]
    module = getattr(fn, "__module__", None) or ""
    names = [getattr(fn, a, None) for a in ("__qualname__", "__name__")]
    # A torch function may live in a private module and be public under torch or F.
    modules = dict.fromkeys((module, "torch", "torch.nn.functional"))
    return [(m, n) for m in modules for n in dict.fromkeys(names)
            if m in sys.modules and isinstance(n, str)]


def portable(targets: Mapping[str, Callable[..., Any]]) -> dict[str, Target | Callable[..., Any]]:
    """Each op's callable as a ``Target`` where one names it, else the callable itself."""
    return {op: reference(fn) or fn for op, fn in targets.items()}


def resolve(targets: Mapping[str, Target | Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """The callables a rank runs, every ``Target`` followed in this process."""
    return {op: t.resolve(op) if isinstance(t, Target) else t for op, t in targets.items()}


def check_sendable(targets: Mapping[str, Target | Callable[..., Any]]) -> None:
    """Fail, naming the op, before a worker process would receive a callable it cannot rebuild."""
    for op, fn in targets.items():
        if isinstance(fn, Target):
            continue
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise TargetError(
                f"op {op} runs {_describe(fn)}, which no module name leads to, so worker "
                f"processes cannot get it ({type(e).__name__}: {e}); define it at the top level "
                "of its file (not inside a function, not a lambda)") from None


def _describe(fn: Any) -> str:
    code = getattr(inspect.unwrap(fn), "__code__", None)  # a registered op's own body
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code else name
