"""The op registry: which calls chronotope knows, and their signatures.

An entry maps a call target (a torch function, a ``Tensor`` method name, an
``aten`` op) to a canonical kind and a signature rule. The rule is a fixed
string, or a function of the call (``OpCall``) that returns one (a reshape's
signature depends on its shapes). The built-in registry is frozen once built; a
user's op made with ``register_op`` carries its entry on itself, so registering
changes no shared state and every registry knows it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from chronotope.errors import SignatureError
from chronotope.graph.ir import TensorMeta
from chronotope.graph.signature import Signature


@dataclass(frozen=True)
class OpCall:
    """A call as a signature rule sees it: tensors replaced by their ``TensorMeta``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[TensorMeta, ...]

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Argument by position or keyword, as Python would bind it (``dim`` also by
        torch's NumPy-style alias, ``axis``)."""
        if name in self.kwargs:
            return self.kwargs[name]
        if name == "dim" and "axis" in self.kwargs:
            return self.kwargs["axis"]
        if index < len(self.args):
            return self.args[index]
        return default

    @property
    def tensors(self) -> list[TensorMeta]:
        """Tensor arguments in the order the op's inputs are listed."""
        return list(iter_tensors((self.args, self.kwargs)))

    @property
    def out(self) -> TensorMeta:
        return self.outputs[0]


SignatureRule = str | Callable[[OpCall], str | None]
# A slicing op's rule for what it reads: the box of its first input (one (lo, hi) per
# axis) and a signature over that box, whose dims then all split like any other.
RegionRule = Callable[[OpCall], tuple[tuple[tuple[int, int], ...], str] | None]
# Records one call as an op of the graph and returns its (meta) result.
Emit = Callable[..., Any]
# A call rewritten into ops that have signatures, given ``emit`` and the call's (meta)
# arguments: the call's result, and the pairs (tensor, its new value) of what it updates
# in place; None keeps the call as one op.
Decomposition = Callable[[Emit, tuple, dict], tuple[Any, tuple[tuple[Any, Any], ...]] | None]


@dataclass(frozen=True)
class OpDef:
    kind: str
    rule: SignatureRule
    # Splitting a "+" dim: a mean-like op must scale each partial by its share, and
    # inputs that enter the output additively (a linear's bias) are value-split,
    # while all other inputs are needed whole by every partial.
    mean_reduction: bool = False
    additive_inputs: tuple[int, ...] = ()
    # The op is linear in these inputs together: pieces taking value shares of them
    # make value shares of the output (ct.ValueSplit), e.g. a sum divided by a count.
    linear_inputs: tuple[int, ...] = ()
    # Linear in each tensor input with the others held (a product): pieces may take value
    # shares of any one input alone.
    linear_each: bool = False
    user: bool = False
    region: RegionRule | None = None
    decompose: Decomposition | None = None
    # where a loss takes its ``reduction`` by position (None: by keyword alone)
    reduction_index: int | None = None

    def averages(self, args: tuple, kwargs: dict[str, Any]) -> bool:
        """Whether a call with these arguments takes a mean over what it reduces (a loss
        without ``reduction="sum"``, or an exported one's enum 1): a part of it is scaled
        by its share."""
        if not self.mean_reduction:
            return False
        at = self.reduction_index
        reduction = kwargs.get("reduction", args[at] if at is not None and at < len(args)
                               else "mean")
        return _REDUCTIONS.get(reduction, reduction) == "mean"

    def value_splits(self, ninputs: int) -> list[tuple[int, ...]]:
        """The sets of inputs a call with ``ninputs`` tensor inputs may take value shares of
        together (``ct.ValueSplit``): its jointly linear inputs, and each input alone for a
        product."""
        found = [self.linear_in(ninputs)] if self.linear_in(ninputs) else []
        if self.linear_each and ninputs > 1:
            found += [(j,) for j in range(ninputs) if (j,) not in found]
        return found

    def linear_in(self, ninputs: int) -> tuple[int, ...]:
        """The inputs a call with ``ninputs`` tensor inputs is linear in: none when one of
        them is a constant instead (``x + 1`` is affine, not linear, in ``x``)."""
        return self.linear_inputs if all(j < ninputs for j in self.linear_inputs) else ()

    def signature(self, call: OpCall) -> Signature | None:
        text = self.rule if isinstance(self.rule, str) else self.rule(call)
        return None if text is None else Signature.parse(text)

    def infer(self, args: tuple, kwargs: dict) -> Any:
        """Meta outputs of a user op from its signature, for bodies that cannot run on meta.

        Outputs take the dtype of the first floating-point input.
        """
        if not self.user or not isinstance(self.rule, str):
            return None
        tensors = [t for t in iter_tensors((args, kwargs)) if isinstance(t, torch.Tensor)]
        dtype = next((t.dtype for t in tensors if t.dtype.is_floating_point), tensors[0].dtype)
        shapes = Signature.parse(self.rule).output_shapes([tuple(t.shape) for t in tensors])
        outs = tuple(torch.empty(s, dtype=dtype, device="meta") for s in shapes)
        return outs[0] if len(outs) == 1 else outs


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # an exported loss's reduction enum

OP_DEF = "__chronotope_op__"  # the attribute of a registered user op that holds its entry


def autograd_function(target: Any) -> type | None:
    """The ``torch.autograd.Function`` whose ``apply`` ``target`` is, if it is one."""
    owner = getattr(target, "__self__", None)
    if (isinstance(owner, type) and issubclass(owner, torch.autograd.Function)
            and getattr(target, "__name__", None) == "apply"):
        return owner
    return None


def iter_leaves(tree: Any) -> Iterable[Any]:
    """Leaves of nested tuples/lists/dicts/slices, in argument order."""
    if isinstance(tree, (tuple, list)):
        for x in tree:
            yield from iter_leaves(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from iter_leaves(x)
    elif isinstance(tree, slice):
        yield from iter_leaves((tree.start, tree.stop, tree.step))
    else:
        yield tree


def iter_tensors(tree: Any) -> Iterable[Any]:
    """Leaves that are tensor-like records (tensors, ``TensorMeta``, pTensors)."""
    for x in iter_leaves(tree):
        if hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, torch.fx.Proxy):
            yield x


def map_leaves(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild nested tuples/lists/dicts/slices with ``fn`` applied to every leaf."""
    if isinstance(tree, tuple):
        mapped = tuple(map_leaves(x, fn) for x in tree)
        if hasattr(tree, "_fields"):  # a namedtuple
            return type(tree)(*mapped)
        if hasattr(type(tree), "n_fields"):  # torch.return_types: x.sort().values
            return type(tree)(mapped)
        return mapped
    if isinstance(tree, list):
        return [map_leaves(x, fn) for x in tree]
    if isinstance(tree, dict):
        return {k: map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, slice):
        return slice(*(map_leaves(x, fn) for x in (tree.start, tree.stop, tree.step)))
    return fn(tree)


class OpRegistry:
    """Targets -> ``OpDef``. Methods are keyed ``"method:<name>"``."""

    def __init__(self) -> None:
        self._defs: dict[Any, OpDef] = {}
        self.frozen = False

    def add(self, targets: Iterable[Any], kind: str, rule: SignatureRule, **kw: Any) -> OpDef:
        if self.frozen:
            raise SignatureError("the built-in op registry is frozen: decorate your function "
                                 "with @chronotope.register_op, or add to a copy() of the "
                                 "registry and capture with it")
        op = OpDef(kind, rule, **kw)
        for t in targets:
            self._defs[t] = op
        return op

    def lookup(self, target: Any) -> OpDef | None:
        """The entry for a target; an operator overload falls back to its packet, then to
        its qualified name (``"transformers::grouped_mm_fallback"``: an op of a library
        that registers it only once imported). A user op carries its own entry."""
        function = autograd_function(target)
        own = function.__dict__.get(OP_DEF) if function is not None else \
            getattr(target, OP_DEF, None)
        if isinstance(own, OpDef):
            return own
        try:
            found = self._defs.get(target)
        except TypeError:  # unhashable target
            return None
        if found is None and isinstance(target, torch._ops.OpOverload):
            found = self._defs.get(target.overloadpacket)
            target = target.overloadpacket
        if found is None and isinstance(target, torch._ops.OpOverloadPacket):
            found = self._defs.get(target._qualified_op_name)
        return found

    def of(self, target: Any) -> OpDef | None:
        """The entry for a captured op's target: a callable, or a method's name."""
        return self.lookup(f"method:{target}" if isinstance(target, str) else target)

    def copy(self) -> OpRegistry:
        """An unfrozen copy, to add entries to."""
        new = OpRegistry()
        new._defs = dict(self._defs)
        return new

    def freeze(self) -> OpRegistry:
        self.frozen = True
        return self


def register_op(signature: SignatureRule, *, name: str | None = None) -> Callable:
    """Decorator: make a function one op of the graph, whatever it does inside.

    ``signature`` is a string (or a function of ``OpCall`` returning one); strings are
    parsed now so a typo fails at import, not at capture. The returned function records
    itself as a single node when traced, and carries its entry (``OP_DEF``), which
    every registry finds. A ``torch.autograd.Function`` (always one op) gets the entry
    itself: each piece of it then runs the Function's own forward and backward.
    """
    if isinstance(signature, str):
        Signature.parse(signature)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
            setattr(fn, OP_DEF, OpDef(name or fn.__name__, signature, user=True))
            return fn
        if not callable(fn):
            raise SignatureError(f"register_op decorates a function, got {fn!r}")

        @functools.wraps(fn)
        def op(*args: Any, **kwargs: Any) -> Any:
            proxy = next((x for x in iter_leaves((args, kwargs))
                          if isinstance(x, torch.fx.Proxy)), None)
            if proxy is not None:
                return proxy.tracer.create_proxy("call_function", op, args, kwargs)
            return fn(*args, **kwargs)

        setattr(op, OP_DEF, OpDef(name or fn.__name__, signature, user=True))
        return op

    return wrap


def method(*names: str) -> list[str]:
    return [f"method:{n}" for n in names]


def everywhere(*names: str) -> list[object]:
    """Every form of the calls ``names``: the Tensor method, and the torch and aten op."""
    found: list[object] = list(method(*names))
    for name in names:
        found += [getattr(ns, name) for ns in (torch, torch.ops.aten) if hasattr(ns, name)]
    return found


def warn_unannotated(kinds: Sequence[str], model: str) -> None:
    if kinds:
        listed = ", ".join(sorted(set(kinds)))
        warnings.warn(
            f"{model}: {len(kinds)} ops have no signature and can only be replicated: {listed}. "
            "Register one with @chronotope.register_op('<signature>') to let plans split them.",
            stacklevel=3,
        )
