"""Built-in workloads by name, and user workloads from ``path/to/file.py:factory``.

Every factory takes ``device``, ``batch_size`` and ``seed`` keywords (plus config
overrides) and returns a :class:`Workload` whose model returns the scalar loss.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from chronotope.errors import ModelLoadError, UnknownModelError
from chronotope.models.bert import bert
from chronotope.models.evoformer import evoformer
from chronotope.models.gpt import gpt
from chronotope.models.hf import hf_bert, hf_gpt2, hf_llama, hf_t5
from chronotope.models.llama import llama
from chronotope.models.swin import swin
from chronotope.models.t5 import t5
from chronotope.workload import Workload

__all__ = ["BUILTINS", "LARGE", "Workload", "default_device", "get_workload", "import_file",
           "load_function", "load_workload"]

BUILTINS: dict[str, Callable[..., Workload]] = {
    "gpt": gpt,
    "llama": llama,
    "bert": bert,
    "t5": t5,
    "swin": swin,
    "evoformer": evoformer,
    "gpt3-1.3b": partial(gpt, preset="gpt3-1.3b"),
    "gpt3-13b": partial(gpt, preset="gpt3-13b"),
    "gpt3-39b": partial(gpt, preset="gpt3-39b"),
    "gpt3-175b": partial(gpt, preset="gpt3-175b"),
    "llama-70b": partial(llama, preset="llama-70b"),
    "llama3-70b": partial(llama, preset="llama3-70b"),
    "hf-gpt2": hf_gpt2,
    "hf-llama": hf_llama,
    "hf-bert": hf_bert,
    "hf-t5": hf_t5,
}

SPEC_FORM = "path/to/file.py:factory"


# Configurations too large to allocate here: built on the meta device unless asked otherwise.
LARGE = frozenset({"gpt3-1.3b", "gpt3-13b", "gpt3-39b", "gpt3-175b", "llama-70b",
                   "llama3-70b"})


def default_device(spec: str) -> str:
    """Where a model is built unless said: the large presets and transformers' default
    configs (``hf:llama`` is 6.7B parameters) without weights, on the meta device."""
    return "meta" if spec in LARGE or spec.startswith("hf:") else "cpu"


def _unknown(name: str) -> UnknownModelError:
    close = difflib.get_close_matches(name, list(BUILTINS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return UnknownModelError(
        f"unknown model {name!r}{hint}. Built-in models: {', '.join(BUILTINS)}; "
        f"or name a factory function in your own file as {SPEC_FORM}"
    )


def get_workload(
    name: str,
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Workload:
    """The built-in workload ``name``; ``overrides`` replace fields of its config."""
    try:
        factory = BUILTINS[name]
    except KeyError:
        raise _unknown(name) from None
    return factory(device=device, batch_size=batch_size, seed=seed, **overrides)


def load_workload(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seed: int = 0,
) -> Workload:
    """A built-in name, a Hugging Face causal language model (a ``save_pretrained``
    folder, a ``config.json``, or ``hf:TYPE`` for a model type's default config), or
    ``path/to/file.py:factory`` calling ``factory`` from that file.

    The factory receives whichever of ``device``, ``batch_size`` and ``seed`` it
    accepts (``batch_size`` only when given); one without ``device`` runs under
    that default device, so what it creates lands there. It may return a
    ``Workload``, ``(model, inputs)`` or ``(model, inputs, loss_fn)``, where
    ``inputs`` is a tensor, a tuple of arguments or a dict of keyword arguments.
    """
    if spec in BUILTINS:
        return get_workload(spec, device=device, batch_size=batch_size, seed=seed)
    path = Path(spec).expanduser()
    if spec.startswith("hf:") or (path / "config.json").is_file() or \
            (path.suffix == ".json" and path.is_file()):  # a Hugging Face model
        from chronotope.models.hf import hf_causal_lm

        return hf_causal_lm(spec, device=device, batch_size=batch_size, seed=seed)
    path_text, colon, func = spec.rpartition(":")
    if not colon or not func.isidentifier():
        if spec.endswith(".py"):
            raise ModelLoadError(
                f"{spec!r} names a file but no factory: write {spec}:factory, where factory "
                "is the function in it that builds the model and its example inputs"
            )
        raise _unknown(spec)
    path = Path(path_text).expanduser()
    label = f"{path_text}:{func}"
    factory = _load_factory(path, func, label)
    kwargs = _accepted(factory, {"device": device, "batch_size": batch_size, "seed": seed})
    if batch_size is not None and "batch_size" not in kwargs:
        raise ModelLoadError(f"{label} takes no batch_size, so a batch size of {batch_size} "
                             "cannot change its example batch: give the factory a batch_size "
                             "parameter, or leave the batch size out")
    torch.manual_seed(seed)  # factories that take no seed still build the same model
    try:
        with _user_dir(path):
            if "device" in kwargs:
                result = factory(**kwargs)
            else:
                with torch.device(device):
                    result = factory(**kwargs)
    except Exception as e:
        raise ModelLoadError(f"{label} raised {type(e).__name__}: {e}") from e
    return _as_workload(result, label, f"{path.stem}.{func}")


def _load_factory(path: Path, func: str, label: str) -> Callable[..., Any]:
    if path.suffix != ".py":
        raise ModelLoadError(f"{label}: expected a Python file ({SPEC_FORM}), got {str(path)!r}")
    if not path.is_file():
        raise ModelLoadError(f"{label}: no such file {str(path)!r}")
    # A private module name: the user's file must not shadow, or be shadowed by, a real module.
    name = "_chronotope_user_" + re.sub(r"\W", "_", str(path.resolve().with_suffix("")))
    try:
        module = import_file(path, name)
    except Exception as e:
        raise ModelLoadError(f"{label}: importing {str(path)!r} failed: "
                             f"{type(e).__name__}: {e}") from e
    factory = getattr(module, func, None)
    if factory is None:
        public = [n for n, v in vars(module).items()
                  if callable(v) and not n.startswith("_") and getattr(v, "__module__", "") == name]
        found = f"; functions in it: {', '.join(public)}" if public else ""
        raise ModelLoadError(f"{label}: {str(path)!r} defines no {func!r}{found}")
    if not callable(factory):
        raise ModelLoadError(f"{label}: {func!r} is a {type(factory).__name__}, not a function")
    return factory


def import_file(path: Path, name: str) -> ModuleType:
    """Run the Python file ``path`` as module ``name``, its folder on ``sys.path`` for its
    sibling imports. Worker processes load a user's file again this way, by its path."""
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        with _user_dir(path):
            module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)  # no half-made module stays behind
        raise
    return module


class _user_dir:
    """Puts the user's file's folder on ``sys.path`` while it runs, for its sibling imports."""

    def __init__(self, path: Path) -> None:
        self.folder = str(path.resolve().parent)
        self.added = False

    def __enter__(self) -> None:
        if self.folder not in sys.path:
            sys.path.insert(0, self.folder)
            self.added = True

    def __exit__(self, *exc: object) -> None:
        if self.added and self.folder in sys.path:
            sys.path.remove(self.folder)


def _accepted(factory: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The offered keywords the factory's signature takes; ``batch_size`` only if given."""
    offered = {k: v for k, v in offered.items() if not (k == "batch_size" and v is None)}
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read: call it bare
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return offered
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in offered.items() if k in names}


def _as_workload(result: Any, label: str, name: str) -> Workload:
    expected = (
        "expected a Workload, (model, inputs) or (model, inputs, loss_fn), where model is an "
        "nn.Module and inputs a tensor, a tuple of arguments or a dict of keyword arguments"
    )
    if isinstance(result, Workload):
        if result.name == "model":
            result.name = name
        return result
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise ModelLoadError(f"{label} returned {_describe(result)}; {expected}")
    model, inputs, *rest = result
    loss_fn = rest[0] if rest else None
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"{label} returned {_describe(model)} as the model; {expected}")
    if loss_fn is not None and not callable(loss_fn):
        raise ModelLoadError(f"{label} returned {_describe(loss_fn)} as loss_fn; {expected}")
    if isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    elif isinstance(inputs, torch.Tensor):
        args, kwargs = (inputs,), {}
    else:
        raise ModelLoadError(f"{label} returned {_describe(inputs)} as inputs; {expected}")
    return Workload(model=model, inputs=args, kwargs=kwargs, loss_fn=loss_fn, name=name)


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return "None" if x is None else f"a {type(x).__name__}"


def load_function(spec: str) -> Callable[..., Any]:
    """The function ``path/to/file.py:fn`` names (a data source, for instance)."""
    path_text, colon, func = spec.rpartition(":")
    if not colon or not func.isidentifier():
        raise ModelLoadError(f"{spec!r}: expected path/to/file.py:function")
    return _load_factory(Path(path_text).expanduser(), func, spec)
