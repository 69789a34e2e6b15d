"""Symbolic tracing with torch.fx that inlines every module and remembers where ops came from.

Each traced value also carries a meta tensor (shape and dtype, no data), so the
model's Python code sees concrete sizes, dtypes and devices — ``x.shape[1]``,
``x.size(-1) // n``, ``torch.finfo(x.dtype)`` and ``len(x)`` work as in eager
mode — while tensor values stay symbolic.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
import sysconfig
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from chronotope.errors import CaptureError
from chronotope.graph.ir import Source
from chronotope.graph.registry import OpRegistry, autograd_function, map_leaves

_TORCH_DIR = os.path.dirname(torch.__file__)
_GRAPH_DIR = os.path.dirname(os.path.abspath(__file__))
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_SKIP_FILES = ("<eval_with_key", "<string>", "<frozen ")
META = torch.device("meta")

# Tensor metadata the model may read as plain Python values while being traced.
_CONCRETE = frozenset({
    "shape", "dtype", "device", "ndim", "is_cuda", "layout", "size", "dim", "numel",
    "nelement", "element_size", "is_floating_point", "is_complex", "ndimension",
})


def is_library_file(file: str) -> bool:
    """Code that is not the user's: torch, capture itself, the standard library, generated code."""
    return (
        file.startswith(_TORCH_DIR)
        or file.startswith(_GRAPH_DIR)
        or file.startswith(_SKIP_FILES)
        or (file.startswith(_STDLIB_DIR) and "-packages" not in file)
    )


def user_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The innermost frame that belongs to the user's code."""
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def frame_source(frame: types.FrameType | None, module: str) -> Source | None:
    if frame is None:
        return None
    code = frame.f_code
    return Source(code.co_filename, frame.f_lineno, code.co_name, module)


def strip_root(path: str, root: str = "model") -> str:
    """``model.layers.3.attn`` -> ``layers.3.attn``: names as the user's model spells them."""
    if path == root:
        return ""
    return path.removeprefix(root + ".")


def device_args(target: Any, args: tuple, kwargs: dict, device: Any) -> tuple[tuple, dict]:
    """Replace every device in a call's arguments by ``device``."""

    def swap(x: Any) -> Any:
        return device if isinstance(x, torch.device) else x

    args, kwargs = map_leaves(args, swap), map_leaves(kwargs, swap)
    if isinstance(kwargs.get("device"), str):
        kwargs = {**kwargs, "device": device}
    if target == "to":
        args = tuple(device if isinstance(a, str) else a for a in args)
    return args, kwargs


def call_on_meta(kind: str, target: Any, args: tuple, kwargs: dict,
                 registry: OpRegistry | None = None) -> Any:
    """Run one call on meta tensors; devices in the arguments become the meta device.

    A registered user op whose body cannot run on meta gets its outputs from
    its signature instead.
    """
    args, kwargs = device_args(target, args, kwargs, META)
    try:
        with torch.no_grad(), torch.device(META):
            if kind == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            return target(*args, **kwargs)
    except Exception:
        opdef = registry.lookup(target) if registry is not None and kind != "call_method" else None
        inferred = opdef.infer(args, kwargs) if opdef is not None else None
        if inferred is None and autograd_function(target) is not None:
            inferred = _run_on_zeros(target, args, kwargs)
        if inferred is None:
            raise
        return inferred


_ZEROS_UP_TO = 1 << 24  # elements of the inputs a Function's forward may run on, to learn shapes


def _run_on_zeros(target: Any, args: tuple, kwargs: dict) -> Any:
    """A Function's outputs (as meta tensors) from its forward run on zeros of its inputs'
    shapes, for a forward that reads values (``.item()``) and so cannot run on meta; None
    when the inputs are too large or it fails there too."""
    metas = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if sum(t.numel() for t in metas) > _ZEROS_UP_TO:
        return None

    def zeros(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.zeros(x.shape, dtype=x.dtype)
        return torch.device("cpu") if x == META else x

    try:
        with torch.no_grad():
            out = target(*map_leaves(args, zeros), **map_leaves(kwargs, zeros))
    except Exception:
        return None
    return pytree.tree_map(lambda x: to_meta(x) if isinstance(x, torch.Tensor) else x, out)


def to_meta(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.is_meta else torch.empty_like(t, device=META)


class MetaProxy(fx.Proxy):
    """A traced value that answers metadata questions from its meta tensor."""

    def _meta(self) -> Any:
        return self.node.meta.get("val")

    def __getattr__(self, k: str) -> Any:
        val = self._meta()
        if k in _CONCRETE and isinstance(val, torch.Tensor):
            return getattr(val, k)
        return super().__getattr__(k)

    def __len__(self) -> int:
        val = self._meta()
        if val is None:
            return super().__len__()
        return len(val)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __iter__(self) -> Any:
        val = self._meta()
        if isinstance(val, (tuple, list)):
            return iter([self[i] for i in range(len(val))])
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            return iter([self[i] for i in range(val.shape[0])])
        return super().__iter__()


_FACTORIES = frozenset(
    getattr(torch, name) for name in (
        "arange", "ones", "zeros", "full", "empty", "rand", "randn", "randint", "randperm",
        "linspace", "logspace", "eye", "tensor", "as_tensor", "scalar_tensor", "empty_strided",
        "tril_indices", "triu_indices",
    )
)


class _RecordFactories(TorchFunctionMode):
    """Records tensor factories whose arguments are all concrete (``torch.arange(T)``).

    With concrete sizes they would otherwise run once at trace time and freeze
    into constants; as ops they run on the training device every step.
    """

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES and not self.tracer.on_meta and not any(
            isinstance(x, fx.Proxy) for x in pytree.tree_leaves((args, kwargs))
        ):
            return self.tracer.create_proxy("call_function", func, args, kwargs)
        return func(*args, **kwargs)


_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod, unbound


def _reentrant_checkpoint() -> type | None:
    """``torch.utils.checkpoint``'s Function for ``use_reentrant=True``: it only saves
    memory, so capture follows the function it checkpoints."""
    from torch.utils import checkpoint

    return getattr(checkpoint, "CheckpointFunction", None)


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``torch.autograd.Function.apply`` while tracing: on traced values, one node whose
    target is that ``apply``, so the op runs the user's forward and, in backward, the
    user's own backward (tracing through ``forward`` would keep its ops and lose its
    gradient rule). A reentrant ``torch.utils.checkpoint`` is followed into the function
    it runs instead."""
    proxy = next((x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, fx.Proxy)),
                 None)
    if proxy is None:
        return _APPLY.__get__(None, cls)(*args, **kwargs)
    if cls is _reentrant_checkpoint():  # (run_function, preserve_rng_state, *inputs)
        return args[0](*args[2:])
    return proxy.tracer.create_proxy("call_function", _APPLY.__get__(None, cls), args, kwargs)


class StateChanged(CaptureError):
    """Forward changed state of the model that a captured step cannot carry."""


def _described(value: Any) -> str:
    if isinstance(value, fx.Proxy):
        return "a traced tensor"
    if isinstance(value, torch.Tensor):
        return f"a tensor {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else type(value).__name__


_UNSET = object()


@contextlib.contextmanager
def _model_state(tracer: Tracer, root: torch.nn.Module) -> Iterator[None]:
    """While tracing: ``Function.apply`` as one node (``_apply``); a traced value assigned
    to a buffer (``self.n += 1``, ``self.ema = 0.9 * self.ema + ...``) recorded as the
    buffer's update. Afterwards the model is as it was; forward changing other state it
    had (a Python counter, a tensor kept for the next step) raises ``StateChanged``
    naming it, as a captured step would never change it."""
    modules = [m for m in root.modules() if m is not root]  # fx keeps its constants on root
    paths = {id(m): strip_root(name) for name, m in root.named_modules()}
    before = {id(m): dict(m.__dict__) for m in modules}
    setattr_ = torch.nn.Module.__setattr__

    def assign(module: torch.nn.Module, name: str, value: Any) -> None:
        buffers = module.__dict__.get("_buffers", {})
        if not isinstance(value, fx.Proxy) or id(module) not in paths:
            return setattr_(module, name, value)
        where = ".".join(p for p in (paths[id(module)], name) if p)
        if name in module.__dict__.get("_parameters", {}):
            raise StateChanged(f"forward assigns a computed tensor to parameter {where}; a "
                               "training step changes parameters only through their gradients")
        old = buffers.get(name)
        if old is None:
            return setattr_(module, name, value)
        new = value.node.meta.get("val")
        if isinstance(new, torch.Tensor) and (new.shape != old.shape or new.dtype != old.dtype):
            raise StateChanged(
                f"forward replaces buffer {where} {str(old.dtype).removeprefix('torch.')}"
                f"{list(old.shape)} with a {str(new.dtype).removeprefix('torch.')}"
                f"{list(new.shape)} tensor; a captured step keeps each buffer's shape and "
                "dtype (write into it in place, or keep what grows out of the model)")
        tracer.create_proxy("call_method", "copy_", (tracer.getattr(name, old, {}), value), {})

    torch.autograd.Function.apply = classmethod(_apply)
    torch.nn.Module.__setattr__ = assign
    try:
        yield
    finally:
        torch.autograd.Function.apply = _APPLY
        torch.nn.Module.__setattr__ = setattr_
        changed = _restore(modules, before, paths)
    if changed:  # only once tracing went through: a failure is reported as itself
        path, key, old, new = changed[0]
        where = ".".join(p for p in (path, key) if p)
        raise StateChanged(
            f"forward changes {where} from {_described(old)} to {_described(new)}: Python "
            "state a captured step cannot see, so every step would run as the first did. "
            "Keep state that changes in a buffer (self.register_buffer), or leave it out "
            "of forward")


def _restore(modules: list[torch.nn.Module], before: dict[int, dict[str, Any]],
             paths: dict[int, str]) -> list[tuple[str, str, Any, Any]]:
    """Each module's attributes as before tracing; the public ones forward changed (torch's
    and libraries' own caches are private)."""
    changed = []
    for m in modules:
        was, now = before[id(m)], m.__dict__
        for key in set(was) | set(now):
            old, new = was.get(key, _UNSET), now.get(key, _UNSET)
            if not key.startswith("_") and old is not _UNSET and not _same(old, new):
                changed.append((paths[id(m)], key, old, new))
        m.__dict__.clear()
        m.__dict__.update(was)
    return changed


def _same(a: Any, b: Any) -> bool:
    """Equal plain values (an int set to itself again), else the same object."""
    if isinstance(a, (int, float, str, bool, type(None))) and type(a) is type(b):
        return a == b
    return a is b


class Tracer(fx.Tracer):
    """Traces through all modules (no leaves), recording each node's source, module, meta
    and grad mode (a node made under ``torch.no_grad()`` passes no gradient)."""

    def __init__(self, example: Mapping[str, torch.Tensor], registry: OpRegistry) -> None:
        super().__init__()
        self.example = example
        self.registry = registry
        self.on_meta = False  # computing a meta value: factories run, they are not recorded
        # the first call that failed on meta tensors (the converter reports it, but a trace
        # that stops further on, for want of the shape it would have made, never gets there)
        self.failed: tuple[fx.Node, list[torch.Tensor], Exception] | None = None

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        self.module_ids = {id(m) for m in root.modules()}
        self.attr_proxies: dict[str, fx.Proxy] = {}
        self.tensor_paths = {
            id(t): name
            for name, t in [*root.named_parameters(), *root.named_buffers()]
        }
        # The training step runs with gradients on, whatever the caller's mode.
        with _RecordFactories(self), _model_state(self, root), torch.enable_grad():
            return super().trace(root, concrete_args)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """Parameters and buffers by a dict lookup (fx searches all of them on every access),
        one node each for the whole trace."""
        name = self.tensor_paths.get(id(attr_val)) if isinstance(attr_val, torch.Tensor) else None
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in self.attr_proxies:
            self.attr_proxies[name] = self.create_proxy("get_attr", name, (), {})
        return self.attr_proxies[name]

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return False

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return MetaProxy(node, self)

    def call_module(self, m: torch.nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if id(m) not in self.module_ids:
            return forward(*args, **kwargs)  # made inside forward (a loss module): inline it
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as e:
            if not hasattr(e, "chronotope_module"):  # the innermost module names the failure
                e.chronotope_module = strip_root(self.path_of_module(m))
            raise

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        module = strip_root(self.scope.module_path)
        node.meta["source"] = frame_source(user_frame(sys._getframe(1)), module)
        node.meta["grad"] = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        node.meta["val"] = self.meta_value(node)
        return node

    def meta_value(self, node: fx.Node) -> Any:
        """Shape and dtype of the node's result, or None when it cannot be known."""
        if node.op == "placeholder":
            value = self.example.get(node.target)
            return None if value is None else to_meta(value)
        if node.op == "get_attr":  # read around the tracer's patched Module.__getattr__
            prefix, _, attr = node.target.rpartition(".")
            mod = self.root.get_submodule(prefix)
            for table in (mod._parameters, mod._buffers, mod.__dict__):
                if attr in table:
                    value = table[attr]
                    return to_meta(value) if isinstance(value, torch.Tensor) else value
            return None
        if node.op not in ("call_function", "call_method"):
            return None
        args = fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
        self.on_meta = True
        try:
            return call_on_meta(node.op, node.target, args, kwargs, self.registry)
        except Exception as e:  # reported by the converter, which knows the op's context
            if self.failed is None:
                inputs = [x for x in pytree.tree_leaves((args, kwargs))
                          if isinstance(x, torch.Tensor)]
                self.failed = (node, inputs, e)
            return None
        finally:
            self.on_meta = False


class Call(torch.nn.Module):
    """``fn`` as a module whose ``forward`` takes named tensors, which fx can trace."""

    def __init__(self, fn: Any, names: list[str]) -> None:
        super().__init__()
        self.fn = fn
        scope: dict[str, Any] = {}
        exec(f"def forward(self, {', '.join(names)}):\n"
             f"    return self.fn({', '.join(names)})\n", scope)
        self.__class__ = type("Call", (Call,), {"forward": scope["forward"]})
