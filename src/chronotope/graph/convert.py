"""From a traced fx graph to a chronotope ``Graph``.

Each node runs once on meta tensors, so shapes come out exact without touching
weights. Python values (sizes, dtypes, devices) fold into constants; only
tensor ops stay. In-place updates become out-of-place ops whose result is a new
version of the tensor (SSA), which later readers of that tensor see.
"""

from __future__ import annotations

import inspect
import operator
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from chronotope.errors import CaptureError
from chronotope.graph import functional, rng
from chronotope.graph.ir import (
    DEVICE,
    NO_GRAD_KINDS,
    Graph,
    Op,
    PTensor,
    Source,
    TensorKind,
    TensorMeta,
    fresh_name,
    takes_grad,
)
from chronotope.graph.mask import Mask, covers_exactly_once
from chronotope.graph.registry import (
    OpCall,
    OpRegistry,
    autograd_function,
    iter_tensors,
    map_leaves,
)
from chronotope.graph.signature import Signature
from chronotope.graph.trace import call_on_meta, device_args, to_meta

_MEAN_LOSSES = frozenset({F.cross_entropy, F.nll_loss})
# their exported forms, where the reduction is an enum: 0 none, 1 mean, 2 sum
_ATEN_MEAN_LOSSES = frozenset({torch.ops.aten.cross_entropy_loss.default,
                               torch.ops.aten.nll_loss.default, torch.ops.aten.nll_loss_nd.default})
_MEAN, _SUM = 1, 2
_VIEW_AS_RESHAPE = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                    torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}
_NOT_INPLACE = frozenset({"requires_grad_", "retain_grad", "share_memory_"})
_IDENTITY_METHODS = frozenset({"cpu", "cuda", "requires_grad_", "retain_grad"})
_RANDOM = re.compile(
    r"rand|dropout|bernoulli|normal(?!ize)|uniform|multinomial|exponential|geometric|cauchy")


def _bound(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An aten op's arguments by name, defaults filled in from its schema."""
    out = {}
    for k, arg in enumerate(op._schema.arguments):
        out[arg.name] = args[k] if k < len(args) else kwargs.get(arg.name, arg.default_value)
    return out


class OpFailed(CaptureError):
    """An op could not run on the example shapes: the inputs, not the frontend, are wrong."""


@dataclass
class View:
    """How a tensor was made as a view of ``parent``: the call that made it (made again
    when the parent changes) and how a write into it reaches the parent."""

    parent: torch.Tensor
    name: str
    target: Any
    args: tuple
    kwargs: dict
    outs: list[torch.Tensor]  # every output of that call (an unbind makes several views)
    source: Source | None


@dataclass
class Leaf:
    """A graph input: a batch tensor, a parameter, a buffer or a constant."""

    name: str
    kind: TensorKind
    value: torch.Tensor


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in iter_tensors(tree) if _is_tensor(x)]


def op_failed(model: str, op: str, inputs: list[torch.Tensor], source: Source | None,
              batch: str, e: Exception) -> CaptureError:
    """Why ``op`` of ``model`` cannot run on the example batch (``batch``, described): its
    inputs' shapes and the op's own complaint, or that it reads tensor values in Python."""
    shapes = ", ".join(str(TensorMeta(tuple(t.shape), t.dtype)) for t in inputs) or "none"
    where = f" at {source}" if source else ""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "meta" in first and ("item" in first or "data-dependent" in first):
        return CaptureError(
            f"{model}: {op}{where} reads tensor values in Python (data-dependent control "
            "flow); keep tensor values inside tensor ops, or wrap the code in a function "
            "registered with @chronotope.register_op"
        )
    return OpFailed(f"{model}: {op}{where} fails on inputs [{shapes}]: {first}. Example batch: "
                    f"{batch}; check the example inputs' shapes")


def target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    function = autograd_function(target)
    if function is not None:
        return function.__name__
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


class Converter:
    def __init__(self, registry: OpRegistry, model_name: str, frontend: str) -> None:
        self.registry = registry
        self.model_name = model_name
        self.frontend = frontend
        self.ops: list[Op] = []
        self.current: dict[int, PTensor] = {}  # id(meta tensor) -> its latest version
        self.alive: list[torch.Tensor] = []  # keeps ids unique while converting
        # Views and writes through them: each view's maker, the writes each base has had,
        # and which of them a view's current version reflects (older: made again on read).
        self.views: dict[int, View] = {}
        self.opaque: set[int] = set()  # views of something other than their first input
        self.writes: dict[int, int] = {}
        self.seen: dict[int, int] = {}
        # autograd's view of the step: what carries a gradient, the grad mode of the call
        # being converted, and each tensor's detached version for calls without grad
        self.requires_grad: set[PTensor] = set()
        self.grad = True
        self.detached: dict[PTensor, PTensor] = {}
        self.tensor_names: set[str] = set()
        self.op_names: set[str] = set()
        self.leaves: dict[str, tuple[torch.Tensor, PTensor]] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.batch: list[PTensor] = []
        self.updated: dict[str, PTensor] = {}  # buffer name -> its value after the step
        self.draws = 0  # random calls so far: the next one's key in the counter stream

    # ---- tensors -------------------------------------------------------------------------

    def new_tensor(self, value: torch.Tensor, name: str, kind: TensorKind,
                   producer: Op | None = None) -> PTensor:
        meta = TensorMeta(tuple(value.shape), value.dtype)
        t = PTensor(fresh_name(name, self.tensor_names, "_v"), meta, kind, producer)
        self.current[id(value)] = t
        self.alive.append(value)
        return t

    def traced(self, node: fx.Node) -> Any:
        """The meta value the fx tracer already computed for this node, if it can be reused."""
        return node.meta.get("val") if self.frontend == "fx" else None

    def leaf(self, leaf: Leaf, meta: Any = None) -> torch.Tensor:
        """The meta value standing for a graph input; a tied weight is one input."""
        if leaf.name in self.leaves:
            return self.leaves[leaf.name][0]
        meta = meta if isinstance(meta, torch.Tensor) else to_meta(leaf.value)
        t = self.new_tensor(meta, leaf.name, leaf.kind)
        t.frozen = leaf.kind is TensorKind.PARAM and not leaf.value.requires_grad
        if (leaf.kind is TensorKind.PARAM and not t.frozen) or (
                leaf.kind is TensorKind.INPUT and leaf.value is not None
                and leaf.value.requires_grad):
            self.requires_grad.add(t)
        self.leaves[leaf.name] = (meta, t)
        if leaf.kind is TensorKind.INPUT:
            self.batch.append(t)
        elif leaf.kind is TensorKind.CONSTANT:
            self.constants[t.name] = leaf.value
        return meta

    # ---- nodes ---------------------------------------------------------------------------

    def run(self, graph: fx.Graph, placeholder: Callable[[fx.Node], Leaf],
            get_attr: Callable[[fx.Node], Leaf], output: Callable[[Any], Any],
            source: Callable[[fx.Node], Source | None]) -> PTensor:
        return self.loss(output(self.evaluate(graph, placeholder, get_attr, source)))

    def evaluate(self, graph: fx.Graph, placeholder: Callable[[fx.Node], Leaf],
                 get_attr: Callable[[fx.Node], Leaf],
                 source: Callable[[fx.Node], Source | None]) -> Any:
        """What ``graph`` returns (meta values), each call converted to an op on the way."""
        env: dict[fx.Node, Any] = {}
        for node in graph.nodes:
            if node.op == "placeholder":
                env[node] = self.leaf(placeholder(node), self.traced(node))
            elif node.op == "get_attr":
                env[node] = self.leaf(get_attr(node), self.traced(node))
            elif node.op in ("call_function", "call_method"):
                args = fx.node.map_arg(node.args, env.__getitem__)
                kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                env[node] = self.call(node, args, kwargs, source(node))
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], env.__getitem__)
            else:
                raise CaptureError(f"{self.model_name}: unexpected {node.op} node {node.name}")
        raise CaptureError(f"{self.model_name}: the traced graph has no output")

    def loss(self, value: Any) -> PTensor:
        if _is_tensor(value):
            self.refresh(value)
        if not _is_tensor(value) or value.dim() != 0 or not value.dtype.is_floating_point:
            got = f"a tensor of shape {list(value.shape)}" if _is_tensor(value) else repr(value)
            raise CaptureError(
                f"{self.model_name}: the training step must end in a scalar floating-point loss, "
                f"got {got}; pass loss_fn= to turn the model's output into a loss"
            )
        return self.current[id(value)]

    def call(self, node: fx.Node, args: tuple, kwargs: dict, source: Source | None) -> Any:
        # An exported graph is functional, so its views may as well be reshapes: its
        # trace-time strides need not match what the real kernels produce.
        target = _VIEW_AS_RESHAPE.get(node.target, node.target)
        if target is operator.getitem and not _is_tensor(args[0]):
            return args[0][args[1]]  # a size, or one output of a multi-output op
        self.grad = node.meta.get("grad", True)
        inputs = _tensors((args, kwargs))
        for x in inputs:
            self.refresh(x)
        if node.op == "call_method" and target in _IDENTITY_METHODS:
            return args[0]
        target, args, kwargs = _shape_read(node, target, args, kwargs)
        if target is torch.ops.aten.copy.default and _is_tensor(args[1]):
            return self.copied(node.name, args[0], args[1], source)
        mutated, target, args, kwargs = self.functional_form(node, target, args, kwargs, source)
        if rng.rewritable(target, args, kwargs):  # a piece of it then draws exactly its slice
            target, kwargs = rng.rewrite(target, kwargs, self.draws)
            self.draws += 1
        if mutated is None and (target in _MEAN_LOSSES or target in _ATEN_MEAN_LOSSES):
            loss = self.mean_as_sum(node.name, target, args, kwargs, source)
            if loss is not None:
                return loss
        if mutated is None and node.op == "call_function":
            rewritten = self.decomposed(node, target, args, kwargs, source)
            if rewritten is not None:
                return rewritten
        result = self.traced(node) if mutated is None else None
        try:
            if result is None:
                result = call_on_meta(node.op, target, args, kwargs, self.registry)
        except RuntimeError as e:
            if "view size is not compatible" not in str(e):
                raise self.op_failed(node, target, inputs, source, e) from e
            # Strides on meta can differ from the real kernel's; the shape is all we need.
            result = call_on_meta("call_method", "reshape", args, kwargs)
        except CaptureError:
            raise
        except Exception as e:  # the op itself rejected these inputs
            raise self.op_failed(node, target, inputs, source, e) from e
        outs = _tensors(result)
        if not outs:
            return result  # metadata (x.shape, x.size(1), x.dtype): folds into a constant
        if mutated is None and all(any(o is i for i in inputs) for o in outs):
            return result  # returns its input unchanged (contiguous on a contiguous tensor)
        if mutated is None and self.as_slices(node.name, target, args, kwargs, outs, source):
            return result
        self.emit(node.name, target, args, kwargs, outs, source)
        if mutated is not None:
            self.write(mutated, outs[0], node.name, source)
            return mutated
        return result

    # ---- views and writes through them ---------------------------------------------------

    def root(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor ``t`` is a view of (through views of views), or ``t`` itself."""
        while (view := self.views.get(id(t))) is not None:
            t = view.parent
        return t

    def refresh(self, t: torch.Tensor) -> None:
        """Make ``t`` again from its base if the base was written since ``t`` was made: a
        view reads what its base holds now."""
        view = self.views.get(id(t))
        if view is None or self.seen[id(t)] == self.writes.get(id(self.root(t)), 0):
            return
        self.refresh(view.parent)
        self.emit(view.name, view.target, view.args, view.kwargs, view.outs, view.source)

    def write(self, t: torch.Tensor, value: torch.Tensor, name: str,
              source: Source | None) -> None:
        """``t`` now holds ``value`` (both meta tensors): each base ``t`` is a view of gets
        ``value`` written into its part, and every other view of them is made again when
        next read. Under ``torch.no_grad()`` the write keeps the tensor's gradient path,
        as autograd does for an in-place op it does not record."""
        chain, values = [t], [value]
        while (view := self.views.get(id(chain[-1]))) is not None:
            target, args = self.scatter(view, values[-1], name, source)
            values.append(self.op_result(f"{name}_write", target, args, {}, source))
            chain.append(view.parent)
        root = chain[-1]
        if not self.grad and self.current[id(root)] in self.requires_grad:
            self.grad = True  # the write itself is recorded, with the gradient passing through
            values[-1] = self.op_result(f"{name}_through", functional.through,
                                        (root, values[-1]), {}, source)
            chain, values = [root], values[-1:]  # its views are made again from it
        for x, v in zip(chain, values):
            self.current[id(x)] = self.current[id(v)]
        self.writes[id(root)] = self.writes.get(id(root), 0) + 1
        for x in chain:
            self.seen[id(x)] = self.writes[id(root)]

    def scatter(self, view: View, value: torch.Tensor, name: str, source: Source | None
                ) -> tuple[Any, tuple]:
        """The call that writes ``value`` into the part of ``view.parent`` that ``view`` is:
        an index assignment for a box (an index, a narrow, a select), the inverse for a
        view of all of it (a reshape, a permutation)."""
        parent, target = view.parent, view.target
        kind = getattr(self.registry.of(target), "kind", None)
        n = parent.dim()
        index: Any = None
        if kind == "getitem" and _basic_index(view.args[1]):
            index = view.args[1]
        elif kind in ("narrow", "select", "slice"):
            dim = int(_argument(view, 1, "dim", 0)) % n
            if kind == "narrow":
                start = int(_argument(view, 2, "start", 0)) % parent.shape[dim]
                at: Any = slice(start, start + int(_argument(view, 3, "length", 0)))
            elif kind == "select":
                at = int(_argument(view, 2, "index", 0))
            else:
                at = slice(_argument(view, 2, "start", None), _argument(view, 3, "end", None),
                           _argument(view, 4, "step", 1))
            index = (*[slice(None)] * dim, at)
        if index is not None:
            return functional.setitem, (parent, index, value)
        if kind == "reshape":
            return torch.reshape, (value, tuple(parent.shape))
        order = _permutation(view, kind, n)
        if order is not None:
            inverse = [0] * n
            for i, d in enumerate(order):
                inverse[d] = i
            return torch.permute, (value, tuple(inverse))
        where = f" at {source}" if source else ""
        raise CaptureError(
            f"{self.model_name}: in-place op {name}{where} writes through a view made by "
            f"{target_name(target)} ({view.name}), which capture cannot follow; write it out "
            "of place, or capture with frontend='export'")

    def as_slices(self, name: str, target: Any, args: tuple, kwargs: dict,
                  outs: list[torch.Tensor], source: Source | None) -> bool:
        """``split`` / ``chunk`` / ``unbind`` as one ``narrow`` / ``select`` per piece.

        Each piece then reads only its own box of the input, so a plan can split
        the pieces (the q, k and v of a fused projection) along their own dims.
        """
        opdef = self.registry.of(target)
        x = args[0] if args else None
        if opdef is None or opdef.kind not in ("split", "unbind") or not _is_tensor(x):
            return False
        n = x.dim()
        if opdef.kind == "unbind":
            d = int(kwargs.get("dim", args[1] if len(args) > 1 else 0)) % n
            for k, o in enumerate(outs):
                self.emit(name, torch.select, (x, d, k), {}, [o], source)
            return True
        changed = [a for a in range(n) if any(o.shape[a] != x.shape[a] for o in outs)]
        if any(o.dim() != n for o in outs) or len(changed) != 1:
            return False
        d, start = changed[0], 0
        for o in outs:
            self.emit(name, torch.narrow, (x, d, start, o.shape[d]), {}, [o], source)
            start += o.shape[d]
        return start == x.shape[d]

    def copied(self, name: str, dst: torch.Tensor, src: torch.Tensor,
               source: Source | None) -> torch.Tensor:
        """``aten.copy(dst, src)`` (an exported graph's form of ``dst.copy_(src)``, which has
        no derivative) as what it makes: ``src`` in ``dst``'s dtype, broadcast to its shape.
        ``dst`` gives only its shape, so its values are not read."""
        value = src
        if src.dtype != dst.dtype:
            value = self.op_result(f"{name}_to", torch.ops.aten._to_copy.default, (value,),
                                   {"dtype": dst.dtype}, source)
        if value.shape != dst.shape:
            value = self.op_result(name, torch.ops.aten.expand.default,
                                   (value, list(dst.shape)), {}, source)
        return value

    def mean_as_sum(self, name: str, target: Any, args: tuple, kwargs: dict,
                    source: Source | None) -> torch.Tensor | None:
        """A mean-reduced loss with ignored targets as ``sum / counted targets``.

        Its denominator depends on the labels, so a piece of the batch cannot
        scale its own mean correctly; a sum and a count both split exactly.
        """
        if target in _ATEN_MEAN_LOSSES:  # (self, target, weight, reduction, ignore_index, ...)
            a = _bound(target, args, kwargs)
            if a["reduction"] != _MEAN:
                return None
            summed_args = tuple(_SUM if k == "reduction" else v for k, v in a.items())
            a = {**a, "reduction": "mean", "size_average": None, "reduce": None}
            summed_kwargs: dict[str, Any] = {}
        else:
            bound = inspect.signature(target).bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            summed_args, summed_kwargs = (), {**a, "reduction": "sum"}
        labels = a["target"]
        if (a["reduction"] != "mean" or a["size_average"] is not None or a["reduce"] is not None
                or labels.dtype.is_floating_point
                or (a["weight"] is not None and a.get("label_smoothing", 0.0))):
            return None
        total = self.op_result(f"{name}_sum", target, summed_args, summed_kwargs, source)
        count = self.op_result(f"{name}_count", functional.loss_denominator,
                               (labels, a["weight"], a["ignore_index"], total.dtype), {}, source)
        return self.op_result(name, operator.truediv, (total, count), {}, source)

    def decomposed(self, node: fx.Node, target: Any, args: tuple, kwargs: dict,
                   source: Source | None) -> Any:
        """A call the registry rewrites into ops with signatures (training-mode batch norm);
        what it updates in place gets the rewritten values as new versions."""
        opdef = self.registry.of(target)
        if opdef is None or opdef.decompose is None:
            return None

        def emit(fn: Any, *a: Any, **kw: Any) -> torch.Tensor:
            return self.op_result(f"{node.name}_{target_name(fn)}", fn, a, kw, source)

        found = opdef.decompose(emit, args, kwargs)
        if found is None:
            return None
        result, updates = found
        for old, new in updates:
            self.check_mutable(old, node, source)
            self.write(old, new, node.name, source)
        return result

    def update(self, name: str, value: torch.Tensor) -> None:
        """Buffer ``name`` ends the step holding ``value`` (an exported graph's mutation)."""
        self.updated[name] = self.current[id(value)]

    def op_result(self, name: str, target: Any, args: tuple, kwargs: dict,
                  source: Source | None) -> torch.Tensor:
        result = call_on_meta("call_function", target, args, kwargs)
        self.emit(name, target, args, kwargs, [result], source)
        return result

    def functional_form(self, node: fx.Node, target: Any, args: tuple, kwargs: dict,
                        source: Source | None) -> tuple[torch.Tensor | None, Any, tuple, dict]:
        """Rewrite an in-place call out of place; return the tensor it updates."""
        if target is operator.setitem:
            mutated, target = args[0], functional.setitem
        elif kwargs.get("inplace") is True:
            mutated, kwargs = args[0], {**kwargs, "inplace": False}
        elif (node.op == "call_method" and target.endswith("_") and not target.startswith("__")
              and target not in _NOT_INPLACE):
            mutated = args[0]
            if target in rng.FILLS:  # new numbers from the counter stream (rewritten below)
                node.op = "call_function"
            elif hasattr(torch.Tensor, target[:-1]) and self.registry.of(target[:-1]):
                target = target[:-1]
            else:
                node.op = "call_function"  # the out-of-place helper is a plain function
                args, target = (args[0], target, *args[1:]), functional.updated
        else:
            return None, target, args, kwargs
        self.check_mutable(mutated, node, source)
        return mutated, target, args, kwargs

    def check_mutable(self, t: Any, node: fx.Node, source: Source | None) -> None:
        where = f" at {source}" if source else ""
        if not _is_tensor(t):
            raise CaptureError(f"{self.model_name}: in-place op {node.name}{where} on a non-tensor")
        current = self.current.get(id(self.root(t)))
        if current is not None and current.kind is TensorKind.PARAM:
            raise CaptureError(
                f"{self.model_name}: in-place update of parameter {current.name} by "
                f"{node.name}{where}; a captured training step may change parameters only "
                "through their gradients (keep state that changes in buffers)"
            )
        if any(id(x) in self.opaque for x in (t, self.root(t))):
            raise CaptureError(
                f"{self.model_name}: in-place op {node.name}{where} writes through a view "
                "whose base capture does not know; write it out of place, or capture with "
                "frontend='export'"
            )

    def op_failed(self, node: fx.Node, target: Any, inputs: list[torch.Tensor],
                  source: Source | None, e: Exception) -> CaptureError:
        batch = ", ".join(f"{t.name} {t.meta}" for t in self.batch)
        return op_failed(self.model_name, f"{target_name(target)} ({node.name})", inputs,
                         source, batch, e)

    def emit(self, node_name: str, target: Any, args: tuple, kwargs: dict,
             outs: list[torch.Tensor], source: Source | None) -> Op:
        def stored(x: Any) -> Any:
            if _is_tensor(x):
                t = self.current[id(x)]
                return t if self.grad or t not in self.requires_grad else \
                    self.detach(t, source)
            return DEVICE if isinstance(x, torch.device) else x

        s_args, s_kwargs = device_args(target, args, kwargs, DEVICE)
        s_args, s_kwargs = map_leaves(s_args, stored), map_leaves(s_kwargs, stored)
        name = fresh_name(node_name, self.op_names, "_v")
        inputs = tuple(iter_tensors((s_args, s_kwargs)))
        op = Op(name, target_name(target), target, s_args, s_kwargs, inputs, (), source=source)
        op.outputs = tuple(
            self.new_tensor(o, name if len(outs) == 1 else f"{name}_{i}", TensorKind.ACTIVATION, op)
            for i, o in enumerate(outs)
        )
        self.made_views(name, target, args, kwargs, outs, source)
        self.annotate(op)
        self.ops.append(op)
        if self.grad and op.kind not in NO_GRAD_KINDS and any(
                t in self.requires_grad for t in inputs):
            self.requires_grad.update(o for o in op.outputs if takes_grad(o.dtype))
        return op

    def made_views(self, name: str, target: Any, args: tuple, kwargs: dict,
                   outs: list[torch.Tensor], source: Source | None) -> None:
        """Remember which outputs are views of the call's first input, and how to make
        them again; a view of another input cannot be written through. (A view of what
        the call made inside itself, as a linear's reshaped product, is a new tensor.)"""
        ins = _tensors((args, kwargs))
        bases = [x if x._base is None else x._base for x in ins]
        for o in outs:
            if o._base is None or not any(o._base is b for b in bases):
                continue
            if o._base is bases[0]:
                self.views[id(o)] = View(ins[0], name, target, args, kwargs, outs, source)
                self.seen[id(o)] = self.writes.get(id(self.root(ins[0])), 0)
            else:
                self.opaque.add(id(o))

    def detach(self, t: PTensor, source: Source | None) -> PTensor:
        """``t`` without its gradient path, made once per version: what a call under
        ``torch.no_grad()`` reads."""
        if t not in self.detached:
            name = fresh_name(f"{t.name}_detach", self.op_names, "_v")
            op = Op(name, "detach", "detach", (t,), {}, (t,), (), source=source)
            op.outputs = (PTensor(fresh_name(name, self.tensor_names, "_v"), t.meta,
                                  TensorKind.ACTIVATION, op),)
            self.annotate(op)
            self.ops.append(op)
            self.detached[t] = op.outputs[0]
        return self.detached[t]

    def annotate(self, op: Op, region: bool = True) -> None:
        """``op``'s kind and signature; a slicing op's over the box it reads, unless not
        ``region``."""
        opdef = self.registry.of(op.target)
        if opdef is None:
            op.note = "no signature registered"
            return
        op.kind = opdef.kind
        as_meta = lambda x: x.meta if isinstance(x, PTensor) else x  # noqa: E731
        call = OpCall(map_leaves(op.args, as_meta), map_leaves(op.kwargs, as_meta),
                      tuple(t.meta for t in op.outputs))
        op.region = None
        if opdef.region is not None and op.inputs and region:
            found = opdef.region(call)
            if found is not None:
                op.region, text = found
                op.signature = Signature.parse(text)
                return
        try:
            sig = opdef.signature(call)
            if sig is not None:
                sig.bind([t.shape for t in op.inputs], [t.shape for t in op.outputs])
        except Exception as e:  # a rule that does not cover this call: replicate-only
            op.note = f"signature rule does not apply: {e}"
            return
        if sig is None:
            op.note = "no signature for this form of the call"
        op.signature = sig

    # ---- result --------------------------------------------------------------------------

    def graph(self, loss: PTensor, name: str, input_names: list[str],
              params: Mapping[str, torch.Tensor] = {}) -> Graph:
        """The captured step; ``params`` (the model's, by name) are all kept, those forward
        never reads too: they get no gradient and are stored as they are."""
        for pname, value in params.items():
            if pname not in self.leaves:
                self.leaf(Leaf(pname, TensorKind.PARAM, value))
        by_kind: dict[TensorKind, dict[str, PTensor]] = {k: {} for k in TensorKind}
        for _, t in self.leaves.values():
            by_kind[t.kind][t.name] = t
        # Buffers updated in place (fx) or by an exported graph's outputs, changed.
        updates = {t.name: self.current[id(meta)] for meta, t in self.leaves.values()
                   if t.kind is TensorKind.BUFFER and self.current[id(meta)] is not t}
        updates.update(self.updated)
        updates = {n: t for n, t in updates.items() if t is not by_kind[TensorKind.BUFFER].get(n)}
        ops = prune(self.ops, loss, updates.values())
        for op in _partly_read(ops):
            self.annotate(op, region=False)
        return Graph(
            ops=ops,
            inputs=list(self.batch),
            params=by_kind[TensorKind.PARAM],
            buffers=by_kind[TensorKind.BUFFER],
            constants=self.constants,
            loss=loss,
            buffer_updates=updates,
            input_names=input_names,
            name=name,
            frontend=self.frontend,
            registry=self.registry,
        )


def _partly_read(ops: list[Op]) -> list[Op]:
    """The slicing ops of parameters of which the graph reads only part: they are made to
    read theirs whole, as the one device does, so that every part of it is stored, given
    its (zero) gradient and updated. Slices that read all of a parameter between them
    (gate and up side by side in one weight) each read their own part."""
    boxes: dict[PTensor, list[Mask]] = defaultdict(list)
    slicing: dict[PTensor, list[Op]] = defaultdict(list)
    for op in ops:
        for k, t in enumerate(op.inputs):
            if t.kind is TensorKind.PARAM:
                if k == 0 and op.region is not None:
                    boxes[t].append(Mask(op.region))
                    slicing[t].append(op)
                else:
                    boxes[t].append(Mask.full(t.shape))
    return [op for t, found in slicing.items()
            if not (any(m == Mask.full(t.shape) for m in boxes[t])
                    or covers_exactly_once(boxes[t], t.shape))
            for op in found]


# Calls that read a tensor argument for its shape, dtype or device only, made to take those
# as constants: a piece of such a call then waits on no other piece for them (a micro-batch
# on the whole batch). ``x.view_as(y)`` -> ``x.view(y.shape)``; ``x.new_zeros(s)`` ->
# ``torch.zeros(s, dtype=x.dtype, device=x.device)``.
_AS_SHAPE = {"view_as": "view", "reshape_as": "reshape", "expand_as": "expand"}
_NEW = {"new_zeros": torch.zeros, "new_ones": torch.ones, "new_empty": torch.empty,
        "new_full": torch.full, "new_tensor": torch.tensor}
_ATEN_NEW = {getattr(torch.ops.aten, name).default: fn for name, fn in _NEW.items()
             if name != "new_tensor"}


def _shape_read(node: fx.Node, target: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    if not args or not _is_tensor(args[0]):
        return target, args, kwargs
    if target in _ATEN_NEW:  # an exported x.new_zeros(size): its other keywords are defaults
        return _ATEN_NEW[target], args[1:], _made_like(args[0], kwargs, {})
    if node.op != "call_method":
        return target, args, kwargs
    if target in _AS_SHAPE and len(args) == 2 and _is_tensor(args[1]):
        return _AS_SHAPE[target], (args[0], tuple(args[1].shape)), kwargs
    if target == "type_as" and len(args) == 2 and _is_tensor(args[1]):
        return "to", (args[0], args[1].dtype), kwargs
    if target in _NEW:
        node.op = "call_function"
        rest = {k: v for k, v in kwargs.items() if k not in ("dtype", "device")}
        return _NEW[target], args[1:], _made_like(args[0], kwargs, rest)
    return target, args, kwargs


def _made_like(x: torch.Tensor, kwargs: dict, rest: dict) -> dict:
    """A factory's keywords for ``x.new_*(..., **kwargs)``: ``x``'s dtype and device unless
    given, and ``rest``."""
    return {"dtype": kwargs.get("dtype") or x.dtype, "device": kwargs.get("device") or x.device,
            **rest}


def _basic_index(index: Any) -> bool:
    """An index of ints, slices (of ints), None and ``...``: its result is a box of views."""
    items = index if isinstance(index, tuple) else (index,)
    return all(it is None or it is Ellipsis or isinstance(it, int) or (
        isinstance(it, slice) and all(v is None or isinstance(v, int)
                                      for v in (it.start, it.stop, it.step)))
        for it in items)


def _argument(view: View, index: int, name: str, default: Any) -> Any:
    return view.kwargs[name] if name in view.kwargs else \
        view.args[index] if index < len(view.args) else default


def _permutation(view: View, kind: str | None, n: int) -> list[int] | None:
    """Where each dim of the view comes from in its parent, for a permuting view."""
    if kind == "permute":
        dims = view.args[1:] if not isinstance(_argument(view, 1, "dims", None), (tuple, list)) \
            else _argument(view, 1, "dims", None)
        return [int(d) % n for d in dims]
    if kind != "transpose":
        return None
    order = list(range(n))
    if view.target is getattr:  # x.T, x.mT
        if view.args[1] == "T":
            return order[::-1]
        a, b = n - 2, n - 1
    elif n < 2:
        return order
    elif len(view.args) < 3 and not view.kwargs:  # x.t()
        a, b = 0, 1
    else:
        a, b = int(_argument(view, 1, "dim0", 0)) % n, int(_argument(view, 2, "dim1", 1)) % n
    order[a], order[b] = order[b], order[a]
    return order


def is_random(op: Op) -> bool:
    """Ops that draw from the RNG: dropping one would shift every later random draw."""
    name = op.target if isinstance(op.target, str) else target_name(op.target)
    return bool(_RANDOM.search(name))


def torch_random(graph: Graph) -> list[Op]:
    """Random ops left on torch's generator (not rewritten to the counter stream): their
    pieces and replicas draw other numbers than one device does."""
    return [op for op in graph.ops if is_random(op) and not rng.drawn(op.target)
            and rng.counter_form(op.target) is None]  # with one, it was kept: it draws nothing


def prune(ops: list[Op], loss: PTensor, keep: Iterable[PTensor] = ()) -> list[Op]:
    """Drop ops neither the loss nor the tensors in ``keep`` (buffers' new values) need,
    except random ones (they keep the RNG stream aligned)."""
    needed = {loss, *keep}
    kept = []
    for op in reversed(ops):
        if any(t in needed for t in op.outputs) or is_random(op):
            needed.update(op.inputs)
            kept.append(op)
    return kept[::-1]
