"""``capture``: a model and an example batch in, a ``Graph`` of the whole training step out.

torch.fx traces first (fast, keeps the user's ops and source lines); a model fx
cannot trace goes through ``torch.export`` instead. Both frontends feed the
same converter, so the graph means the same thing either way.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import keyword
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from chronotope.errors import CaptureError
from chronotope.graph.convert import Converter, Leaf, OpFailed
from chronotope.graph.ir import Graph, Source, TensorKind
from chronotope.graph.ops import DEFAULT_REGISTRY
from chronotope.graph.registry import OpRegistry, warn_unannotated
from chronotope.graph.trace import Tracer, frame_source, is_library_file, strip_root, user_frame
from chronotope.models.workload import Workload

Frontend = Literal["auto", "fx", "export"]


def model_loss(output: Any) -> Any:
    """The loss inside a model's output: itself, the first item, or the ``loss`` entry."""
    if isinstance(output, (torch.Tensor, fx.Proxy)):
        return output
    if isinstance(output, Mapping) or hasattr(output, "loss"):
        loss = output["loss"] if isinstance(output, Mapping) else output.loss
        if loss is None:
            raise CaptureError("the model returned no loss (loss is None); pass its labels "
                               "in the example batch, or pass loss_fn=")
        return loss
    if isinstance(output, (tuple, list)):
        return output[0]
    return output


@dataclass
class Batch:
    """The example batch, flattened: tensors become graph inputs, the rest stays constant."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    targets: tuple[Any, ...]

    @classmethod
    def of(cls, example_inputs: Any, kwargs: Mapping[str, Any] | None = None,
           targets: tuple[Any, ...] = ()) -> Batch:
        """Accept a tensor, a tuple of arguments, or a dict of keyword arguments."""
        kwargs = dict(kwargs or {})
        if isinstance(example_inputs, Mapping):
            example_inputs, kwargs = (), {**example_inputs, **kwargs}
        elif not isinstance(example_inputs, (tuple, list)):
            example_inputs = (example_inputs,)
        return cls(tuple(example_inputs), kwargs, tuple(targets))

    def tensors(self) -> list[torch.Tensor]:
        return [x for x in self.leaves()[0] if isinstance(x, torch.Tensor)]

    def leaves(self) -> tuple[list[Any], pytree.TreeSpec]:
        return pytree.tree_flatten((self.args, self.kwargs, self.targets))

    def tensor_names(self, model: nn.Module) -> list[str]:
        """Argument names for the tensor leaves, from the model's forward signature."""
        try:
            bound = inspect.signature(model.forward).bind_partial(*self.args).arguments
            arg_names = list(bound)
        except (TypeError, ValueError):
            arg_names = []
        arg_names += [f"arg{i}" for i in range(len(arg_names), len(self.args))]
        top = (
            list(zip(arg_names, self.args))
            + list(self.kwargs.items())
            + [("target" if i == 0 else f"target_{i}", t) for i, t in enumerate(self.targets)]
        )
        names: list[str] = []
        for name, value in top:
            if isinstance(value, torch.Tensor):
                names.append(name)
            else:
                n = sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value))
                names += [f"{name}_{i}" for i in range(n)]
        return _identifiers(names)


def _identifiers(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        n = re.sub(r"\W", "_", n)
        if not n or n[0].isdigit() or keyword.iskeyword(n) or n == "self":
            n = f"x_{n}"
        while n in out:
            n += "_"
        out.append(n)
    return out


class Step(nn.Module):
    """The training step as one module: the model under ``model``, returning the loss.

    Its ``forward`` takes the batch's tensors as named arguments, so both
    frontends see plain tensor inputs named after the model's own arguments.
    """

    def __init__(self, model: nn.Module, batch: Batch, loss_fn: Callable[..., Any] | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        leaves, self.spec = batch.leaves()
        self.constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self.tensors = batch.tensors()
        self.names = batch.tensor_names(model)
        if len(self.names) != len(self.tensors):
            self.names = _identifiers([f"input{i}" for i in range(len(self.tensors))])
        # Tracers read ``forward`` from the class, so each Step gets a class of its own.
        params = ", ".join(self.names)
        scope: dict[str, Any] = {}
        exec(f"def forward(self, {params}):\n    return self.step({params})\n", scope)
        self.__class__ = type("Step", (Step,), {"forward": scope["forward"]})

    def step(self, *tensors: Any) -> Any:
        it = iter(tensors)
        leaves = [next(it) if c is None else c for c in self.constants]
        args, kwargs, targets = pytree.tree_unflatten(leaves, self.spec)
        output = self.model(*args, **kwargs)
        if self.loss_fn is not None:
            return self.loss_fn(output, *targets)
        return model_loss(output)


def capture(
    model: nn.Module | Workload,
    example_inputs: Any = (),
    loss_fn: Callable[..., Any] | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    targets: tuple[Any, ...] = (),
    registry: OpRegistry | None = None,
    frontend: Frontend = "auto",
    name: str | None = None,
) -> Graph:
    """Capture ``loss = loss_fn(model(*example_inputs, **kwargs), *targets)`` as a Graph.

    Without ``loss_fn`` the model's output is the loss (a scalar, or the first
    item / ``loss`` entry of what it returns). A model built on the meta device
    is captured without allocating its weights.
    """
    if isinstance(model, Workload):
        w = model
        model, example_inputs, kwargs = w.model, w.inputs, {**w.kwargs, **(kwargs or {})}
        targets, loss_fn, name = targets or w.targets, loss_fn or w.loss_fn, name or w.name
    name = name or type(model).__name__
    step = Step(model, Batch.of(example_inputs, kwargs, targets), loss_fn)
    registry = registry or DEFAULT_REGISTRY

    if frontend == "export":
        try:
            graph = capture_export(step, registry, name)
        except Exception as export_error:
            raise _capture_error(name, "torch.export", export_error) from export_error
    else:
        try:
            graph = capture_fx(step, registry, name)
        except OpFailed:
            raise  # the example batch does not fit the model: the other frontend would agree
        except Exception as fx_error:
            if frontend == "fx":
                raise _capture_error(name, "torch.fx", fx_error) from fx_error
            try:
                graph = capture_export(step, registry, name)
            except Exception as export_error:
                raise _capture_error(name, "torch.fx", fx_error, export_error) from export_error
    warn_unannotated([op.kind for op in graph.unannotated_ops()], name)
    return graph


def capture_fx(step: Step, registry: OpRegistry, name: str) -> Graph:
    placeholders = dict(zip(step.names, step.tensors))
    tracer = Tracer(placeholders, registry)
    fx_graph = tracer.trace(step)
    root = tracer.root
    params = {id(p): n for n, p in step.model.named_parameters()}
    buffers = {id(b): n for n, b in step.model.named_buffers()}

    def get_attr(node: fx.Node) -> Leaf:
        value = root
        for part in node.target.split("."):
            value = getattr(value, part)
        if id(value) in params:
            return Leaf(params[id(value)], TensorKind.PARAM, value)
        if id(value) in buffers:
            return Leaf(buffers[id(value)], TensorKind.BUFFER, value)
        return Leaf(strip_root(node.target).replace(".", "_"), TensorKind.CONSTANT, value)

    conv = Converter(registry, name, "fx")
    loss = conv.run(
        fx_graph,
        placeholder=lambda n: Leaf(n.target, TensorKind.INPUT, placeholders[n.target]),
        get_attr=get_attr,
        output=lambda v: v,
        source=lambda n: n.meta.get("source"),
    )
    return conv.graph(loss, name, step.names)


def capture_export(step: Step, registry: OpRegistry, name: str) -> Graph:
    from torch.export.graph_signature import InputKind, OutputKind

    with _export_output():
        ep = torch.export.export(step, tuple(step.tensors), strict=False)
    ep = ep.run_decompositions({})  # functional: in-place updates become new tensors
    sig = ep.graph_signature
    model_params = dict(step.model.named_parameters())
    names = {id(p): n for n, p in model_params.items()}
    batch = iter(zip(step.names, step.tensors))
    leaves: dict[str, Leaf] = {}
    for spec in sig.input_specs:
        if spec.kind is InputKind.USER_INPUT:
            arg_name, value = next(batch)
            leaves[spec.arg.name] = Leaf(arg_name, TensorKind.INPUT, value)
        elif spec.kind is InputKind.PARAMETER:
            value = ep.state_dict[spec.target]
            pname = names.get(id(value), strip_root(spec.target))
            leaves[spec.arg.name] = Leaf(pname, TensorKind.PARAM, value)
        elif spec.kind is InputKind.BUFFER:
            value = ep.state_dict[spec.target] if spec.target in ep.state_dict \
                else ep.constants[spec.target]
            leaves[spec.arg.name] = Leaf(strip_root(spec.target), TensorKind.BUFFER, value)
        elif spec.kind in (InputKind.CONSTANT_TENSOR,):
            leaves[spec.arg.name] = Leaf(strip_root(spec.target).replace(".", "_"),
                                         TensorKind.CONSTANT, ep.constants[spec.target])
        else:
            raise CaptureError(f"{name}: unsupported exported input {spec.arg.name} ({spec.kind})")
    loss_index = [i for i, s in enumerate(sig.output_specs) if s.kind is OutputKind.USER_OUTPUT]
    mutated = {i: strip_root(s.target) for i, s in enumerate(sig.output_specs)
               if s.kind is OutputKind.BUFFER_MUTATION}

    def output(values: Any) -> Any:
        for i, buffer in mutated.items():
            conv.update(buffer, values[i])
        return values[loss_index[0]]

    conv = Converter(registry, name, "export")
    loss = conv.run(
        ep.graph,
        placeholder=lambda n: leaves[n.name],
        get_attr=lambda n: Leaf(n.target, TensorKind.CONSTANT, getattr(ep.graph_module, n.target)),
        output=output,
        source=export_source,
    )
    return conv.graph(loss, name, step.names)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def export_source(node: fx.Node) -> Source | None:
    """The user's line behind an exported node, from the stack trace export records."""
    module = ""
    stack = node.meta.get("nn_module_stack")
    if stack:
        module = strip_root(list(stack.values())[-1][0])
    for file, line, fn in reversed(_FRAME.findall(node.meta.get("stack_trace") or "")):
        if not is_library_file(file):
            return Source(file, int(line), fn, module)
    return None


def _capture_error(name: str, first: str, error: Exception,
                   fallback: Exception | None = None) -> CaptureError:
    """Name where tracing stopped and what to try: the first line of each error and the
    user's line it stopped at, not the frontends' whole text."""
    if isinstance(error, CaptureError) and fallback is None:
        return error
    source = _user_source(error)
    where = f"\n  at {source}" if source else ""
    lines = [f"cannot capture {name}: {first} failed: {_first_line(error)}{where}"]
    if fallback is not None:
        again = _user_source(fallback)
        there = f"\n  at {again}" if again and str(again) != str(source) else ""
        lines.append(f"  torch.export failed too: {_first_line(fallback)}{there}")
    lines.append(
        "  What to try: keep Python control flow off tensor values (no `if` on a tensor, "
        ".item(), .tolist()), wrap code that must do so in a function registered with "
        "@chronotope.register_op('<signature>'), or check that the example inputs are the "
        "ones forward() expects."
    )
    return CaptureError("\n".join(lines))


def _user_source(error: Exception) -> Source | None:
    """The innermost line of the user's code the error passed through."""
    frame = None
    tb = error.__traceback__
    while tb is not None:
        if user_frame(tb.tb_frame) is tb.tb_frame:
            frame = tb.tb_frame
        tb = tb.tb_next
    return frame_source(frame, getattr(error, "chronotope_module", ""))


_LONGEST_LINE = 300


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) > _LONGEST_LINE:
        line = line[:_LONGEST_LINE] + " ..."
    return f"{type(e).__name__}: {line}".rstrip(": ")


@contextlib.contextmanager
def _export_output() -> Iterator[None]:
    """Hold back what torch.export prints: on failure it prints the partial graph to stderr
    (hundreds of lines for a real model) before raising, and the error says why anyway.
    What a successful export prints is passed on."""
    held = io.StringIO()
    with contextlib.redirect_stderr(held):
        yield
    sys.stderr.write(held.getvalue())
