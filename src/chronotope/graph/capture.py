"""``capture``: a model and an example batch in, a ``Graph`` of the whole training step out.

torch.fx traces first (fast, keeps the user's ops and source lines); a model fx
cannot trace goes through ``torch.export`` instead. Both frontends feed the
same converter, so the graph means the same thing either way. Hugging Face's MoE
experts are traced as one op each (``graph/experts.py``).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from chronotope.errors import CaptureError
from chronotope.graph.batch import Batch, identifiers, model_loss
from chronotope.graph.convert import Converter, Leaf, OpFailed, op_failed, target_name
from chronotope.graph.experts import hugging_face_experts, refuse_experts
from chronotope.graph.functions import sign_functions
from chronotope.graph.ir import Graph, Source, TensorKind, TensorMeta
from chronotope.graph.ops import DEFAULT_REGISTRY
from chronotope.graph.registry import OpRegistry, warn_unannotated
from chronotope.graph.trace import (
    StateChanged,
    Tracer,
    frame_source,
    is_library_file,
    strip_root,
    user_frame,
)
from chronotope.graph.verify import CHECK_UP_TO, CaptureMismatch, skipped, verify
from chronotope.workload import Workload

Frontend = Literal["auto", "fx", "export"]


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
            self.names = identifiers([f"input{i}" for i in range(len(self.tensors))])
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
    check_up_to: int | None = CHECK_UP_TO,
) -> Graph:
    """Capture ``loss = loss_fn(model(*example_inputs, **kwargs), *targets)`` as a Graph.

    Without ``loss_fn`` the model's output is the loss (a scalar, or the first
    item / ``loss`` entry of what it returns). A model built on the meta device
    is captured without allocating its weights.

    Capture then checks itself: the graph and the model as written run once each on the
    example batch, and a loss, gradient or buffer update that differs raises
    ``CaptureMismatch`` naming it (``graph/verify.py``). Models with more than
    ``check_up_to`` parameters, or on the meta device, are not run; 0 skips the check.
    """
    if isinstance(model, Workload):
        w = model
        model, example_inputs, kwargs = w.model, w.inputs, {**w.kwargs, **(kwargs or {})}
        targets, loss_fn, name = targets or w.targets, loss_fn or w.loss_fn, name or w.name
    name = name or type(model).__name__
    _refuse_wrapped(model, name)
    refuse_experts(model, name)
    step = Step(model, Batch.of(example_inputs, kwargs, targets), loss_fn)
    registry = registry or DEFAULT_REGISTRY

    check = not skipped(model, step.tensors, check_up_to)
    if frontend == "export":
        try:
            graph = capture_export(step, registry, name)
        except Exception as export_error:
            raise _capture_error(name, "torch.export", export_error) from export_error
        if check:
            _verify(graph, step)
    else:
        try:
            graph = capture_fx(step, registry, name)
            if check:
                _verify(graph, step)
        except (OpFailed, StateChanged):
            raise  # the example batch does not fit the model, or forward changes state the
            # step cannot carry: the other frontend would agree
        except Exception as fx_error:
            if frontend == "fx":
                if isinstance(fx_error, CaptureMismatch):
                    raise
                raise _capture_error(name, "torch.fx", fx_error) from fx_error
            try:
                graph = capture_export(step, registry, name)
            except Exception as export_error:
                if isinstance(fx_error, CaptureMismatch):
                    raise fx_error from None
                if isinstance(fx_error, Stopped):
                    raise fx_error.failed from export_error
                raise _capture_error(name, "torch.fx", fx_error, export_error) from export_error
            if check:
                try:
                    _verify(graph, step)
                except CaptureMismatch:  # fx's account of the difference: its ops are the user's
                    raise (fx_error if isinstance(fx_error, CaptureMismatch) else
                           _capture_error(name, "torch.fx", fx_error)) from None
    sign_functions(graph)
    warn_unannotated([op.kind for op in graph.unannotated_ops()], name)
    return graph


def _verify(graph: Graph, step: Step) -> None:
    """``verify`` the graph against the model it came from, on the example batch."""
    leaves = {t.name: v for t, v in zip(graph.inputs, step.tensors)}
    leaves.update(step.model.named_parameters())
    leaves.update(step.model.named_buffers())
    verify(graph, step.model, step.step, step.tensors, leaves)


def _refuse_wrapped(model: nn.Module, name: str) -> None:
    """A model another parallelism already wrapped (its weights DTensors, or inside a
    DDP or FSDP module) is refused in one line: chronotope plans from the model as
    written on one device."""
    if hasattr(model, "module") and type(model).__name__ in (
            "DistributedDataParallel", "FullyShardedDataParallel", "DataParallel"):
        raise CaptureError(f"{name} is wrapped by {type(model).__name__}: pass the model "
                           "inside it (its .module), as written for one device")
    for pname, p in model.named_parameters():
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            by = "fully_shard" if any(type(m).__name__.startswith("FSDP") for m in
                                      model.modules()) else "parallelize_module"
            raise CaptureError(f"{name} is already parallelized (its parameter {pname} is a "
                               f"DTensor, as {by} makes it): pass the model as written for "
                               "one device, before any fully_shard or parallelize_module; "
                               "chronotope plans the parallelism itself")


def capture_fx(step: Step, registry: OpRegistry, name: str) -> Graph:
    placeholders = dict(zip(step.names, step.tensors))
    tracer = Tracer(placeholders, registry)
    try:
        with hugging_face_experts(step.model):
            fx_graph = tracer.trace(step)
    except Exception as e:
        if tracer.failed is None:
            raise
        node, inputs, cause = tracer.failed
        batch = ", ".join(f"{n} {TensorMeta(tuple(t.shape), t.dtype)}"
                          for n, t in placeholders.items())
        raise Stopped(op_failed(name, f"{target_name(node.target)} ({node.name})", inputs,
                                node.meta.get("source"), batch, cause), e) from e
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
    return conv.graph(loss, name, step.names, dict(step.model.named_parameters()))


class Stopped(CaptureError):
    """fx stopped tracing after an op failed on the example shapes: the op's failure (the
    likelier cause: what it would have made was missing further on), kept to report should
    torch.export fail too."""

    def __init__(self, failed: CaptureError, stopped: Exception) -> None:
        super().__init__(f"{failed}\n  (fx then stopped: {_first_line(stopped)})")
        self.failed = failed


def capture_export(step: Step, registry: OpRegistry, name: str) -> Graph:
    from torch.export.graph_signature import InputKind, OutputKind

    with _export_output(), torch.enable_grad(), hugging_face_experts(step.model):
        ep = torch.export.export(step, tuple(step.tensors), strict=False)
    _detach_no_grad_blocks(ep.graph)
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
    return conv.graph(loss, name, step.names, model_params)


def _detach_no_grad_blocks(graph: fx.Graph) -> None:
    """What a ``torch.no_grad()`` block reads, detached: the block then passes no gradient
    once its ops are inlined into the decomposed graph, which keeps no grad mode."""
    for node in list(graph.nodes):
        if node.target is not torch.ops.higher_order.wrap_with_set_grad_enabled \
                or node.args[0] is not False:
            continue
        with graph.inserting_before(node):
            reads = [graph.call_function(torch.ops.aten.detach.default, (a,))
                     if isinstance(a, fx.Node) else a for a in node.args[2:]]
        node.args = (*node.args[:2], *reads)
    graph.lint()


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
