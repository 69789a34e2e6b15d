"""How a step holds its tensors: each one's dtype under ``torch.autocast``, and what
autograd keeps of each op for its backward.

A bf16 or fp16 run keeps fp32 master weights and lets autocast choose each op's dtype
(``runtime/precision.py``): a linear's output is 16-bit, a layer norm's fp32, an add of
the two fp32. Autograd keeps what each op's backward needs and no more: a linear its
input (the 16-bit copy autocast made of it), a layer norm its input and statistics, an
add nothing; a view shares its input's storage. What a plan holds and sends depends on
both, so they are inferred once per graph and dtype by running each op, forward and
backward, on fake tensors (shapes and dtypes only, no compute), with the torch version
that runs the step. Each distinct call runs once: GPT-3 175B's 2,100 ops are 30 calls on
30 layouts, followed in about a second.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from chronotope.graph.ir import Graph, Op, PTensor, takes_grad
from chronotope.graph.memory import PeakMemory

# What a step computes in, by the names plans, the command line and the runtime use.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16}
LOW = {name: d for name, d in DTYPES.items() if d != torch.float32}


@dataclass(frozen=True)
class Saves:
    """What autograd keeps of one op from its forward to its backward, by position among
    the op's tensor inputs and outputs."""

    inputs: frozenset[int]  # inputs kept as they are (or a view of them)
    outputs: frozenset[int]  # outputs kept
    cast: frozenset[int]  # inputs kept as the 16-bit copy autocast made of them
    other: int  # bytes of the other tensors it keeps (statistics, masks), for the whole op
    views: tuple[tuple[int, int], ...]  # (output, input): outputs sharing an input's storage
    # Bytes made and freed inside the op's forward and inside its backward, at most at once
    # beyond what is left at the end (a loss's gradient on the way to its logits' one).
    forward_temp: int = 0
    backward_temp: int = 0


@dataclass
class _Followed:
    dtypes: dict[PTensor, torch.dtype | None]
    saves: dict[Op, Saves]  # the ops that could be followed


_inferred: weakref.WeakKeyDictionary[Graph, dict[str, _Followed]] = weakref.WeakKeyDictionary()


def _followed(graph: Graph, dtype: str) -> _Followed:
    known = _inferred.setdefault(graph, {})
    if dtype not in known:
        known[dtype] = _follow(graph, LOW.get(dtype))
    return known[dtype]


def autocast_dtypes(graph: Graph, dtype: str) -> dict[PTensor, torch.dtype | None]:
    """Each tensor's dtype when ``graph`` runs under autocast in ``dtype`` ("bf16",
    "fp16"; "fp32": as captured); None for a tensor made after an op that could not be
    followed on fake tensors. CPU's autocast policy (a CUDA one needs a CUDA build to
    follow; both lower matmuls, convolutions and attention)."""
    if dtype not in LOW:
        return {t: t.dtype for op in graph.ops for t in (*op.inputs, *op.outputs)}
    return _followed(graph, dtype).dtypes


def saves(graph: Graph, dtype: str) -> dict[Op, Saves]:
    """What autograd keeps of each op of ``graph`` run in ``dtype``; an op missing could
    not be followed on fake tensors (keep all its inputs and outputs, to be safe)."""
    return _followed(graph, dtype).saves


def casts(op: Op, dtypes: dict[PTensor, torch.dtype | None]) -> bool:
    """Whether autocast runs ``op`` in 16 bits on fp32 inputs: it makes a 16-bit copy of
    each (a weight's copy is saved for the backward with the op's other inputs)."""
    low = any(dtypes.get(t) in LOW.values() for t in op.outputs)
    return low and any(dtypes.get(t, t.dtype) == torch.float32 for t in op.inputs)


def itemsizes(graph: Graph, dtype: str) -> dict[PTensor, int]:
    """Bytes per element of each tensor as a run in ``dtype`` holds it (its captured
    dtype where unknown)."""
    return {t: (found or t.dtype).itemsize
            for t, found in autocast_dtypes(graph, dtype).items()}


def casting(graph: Graph, dtype: str) -> set[Op]:
    """The ops that keep a 16-bit copy of the fp32 tensors they read (``casts``)."""
    if dtype not in LOW:
        return set()
    dtypes = autocast_dtypes(graph, dtype)
    return {op for op in graph.ops if casts(op, dtypes)}


def storage_of(graph: Graph, dtype: str) -> dict[PTensor, PTensor]:
    """Each view (an output sharing an input's storage) -> the tensor that owns it."""
    found = saves(graph, dtype)
    root: dict[PTensor, PTensor] = {}
    for op in graph.ops:
        for out, src in found[op].views if op in found else ():
            root[op.outputs[out]] = root.get(op.inputs[src], op.inputs[src])
    return root


def saved_tensors(graph: Graph, dtype: str, ops: set[Op]) -> set[PTensor]:
    """The tensors whose storage autograd keeps for the backward of ``ops`` (those with
    one): what each saves (all of an op not followed), a view as the tensor it shares."""
    found, root = saves(graph, dtype), storage_of(graph, dtype)
    out: set[PTensor] = set()
    for op in graph.ops:
        if op not in ops:
            continue
        kept = found.get(op)
        tensors = (*op.inputs, *op.outputs) if kept is None else (
            *(op.inputs[j] for j in kept.inputs), *(op.outputs[j] for j in kept.outputs))
        out.update(root.get(t, t) for t in tensors)
    return out


def _follow(graph: Graph, dtype: torch.dtype | None) -> _Followed:
    """Run ``graph``'s ops on fake tensors (under autocast in ``dtype``, unless None) with
    autograd on, noting each tensor's dtype and what each op's autograd saves."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device("cpu")
    values: dict[PTensor, _Value] = {}
    storages = itertools.count()
    followed = _Followed({}, {})
    wants = set(graph.params.values())  # the tensors a gradient flows to: made from weights
    cast = torch.autocast("cpu", dtype=dtype, cache_enabled=False) if dtype else \
        contextlib.nullcontext()
    # A stack's layers repeat the same calls on the same layouts: each distinct call is
    # run once, and its outputs' layouts (views where they were) stand for the rest's.
    known: dict[tuple, tuple[list[_Made | None], Saves | None] | None] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), cast, torch.enable_grad(), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in graph.ops:
            for t in op.inputs:
                followed.dtypes.setdefault(t, t.dtype if _leaf(t, graph) else None)
            found: tuple[list[_Made | None], Saves | None] | None = None
            if all(t in values or _leaf(t, graph) for t in op.inputs):
                for t in op.inputs:
                    if t not in values:
                        values[t] = _Value.fresh(t.shape, t.dtype, next(storages))
                given = [values[t] for t in op.inputs]
                wanted = [t in wants and takes_grad(v.dtype)
                          for t, v in zip(op.inputs, given)]
                key = _call(op, given, wanted)
                if key not in known:
                    known[key] = _run(op, given, wanted, device)
                found = known[key]
            made, kept_by = found if found is not None else ([], None)
            for i, t in enumerate(op.outputs):
                out = made[i] if i < len(made) else None
                if out is not None:
                    values[t] = out.make([values[x] for x in op.inputs], next(storages))
                followed.dtypes[t] = out.dtype if out is not None else None
            if any(t in wants for t in op.inputs):
                wants.update(op.outputs)
            if kept_by is not None:
                followed.saves[op] = kept_by
    return followed


@dataclass(frozen=True)
class _Value:
    """A tensor as an op sees it, without making it: its layout, dtype and storage."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    storage: int  # which (the follower's numbering)
    nbytes: int  # of the storage

    @staticmethod
    def fresh(shape: tuple[int, ...], dtype: torch.dtype, storage: int) -> _Value:
        stride = tuple(math.prod(max(n, 1) for n in shape[k + 1:]) for k in range(len(shape)))
        return _Value(tuple(shape), stride, 0, dtype, storage, math.prod(shape) * dtype.itemsize)


@dataclass(frozen=True)
class _Made:
    """An output of a followed call: enough to stand for it in a call alike."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int  # of its storage
    view_of: int | None  # the input whose storage it shares

    def make(self, inputs: list[_Value], storage: int) -> _Value:
        """It, given the call's inputs (``storage``: a fresh one's number)."""
        if self.view_of is not None:
            shared = inputs[self.view_of]
            storage, nbytes = shared.storage, shared.nbytes
        else:
            nbytes = self.nbytes
        return _Value(self.shape, self.stride, self.offset, self.dtype, storage, nbytes)


def _fakes(given: list[_Value], wanted: list[bool]) -> list[torch.Tensor]:
    """Fake tensors of ``given``'s layouts, those of one storage sharing one, each a leaf
    of its own (same storage) that wants a gradient where ``wanted`` (what an op keeps
    depends on it: ``x * cos`` keeps ``cos`` alone): the op's backward alone."""
    bases: dict[int, torch.Tensor] = {}
    out = []
    for v, want in zip(given, wanted):
        shared = sum(u.storage == v.storage for u in given) > 1
        if not shared and v.offset == 0:
            x = torch.empty_strided(v.shape, v.stride, dtype=v.dtype)
        else:
            base = bases.setdefault(v.storage, torch.empty(v.nbytes, dtype=torch.uint8))
            x = base.view(v.dtype).as_strided(v.shape, v.stride, v.offset)
        out.append(x.detach().requires_grad_(want))
    return out


def _run(op: Op, given: list[_Value], wanted: list[bool], device: torch.device,
         ) -> tuple[list[_Made | None], Saves | None] | None:
    """Run ``op`` on fake tensors of ``given``'s layouts: its outputs and what its autograd
    saves (None when the outputs are not all tensors); None when fake tensors cannot run
    it."""
    from chronotope.graph.execute import run_op

    kept: list[torch.Tensor] = []

    def keep(x: torch.Tensor) -> torch.Tensor:
        kept.append(x)
        return x

    try:
        fakes = dict(zip(op.inputs, _fakes(given, wanted)))
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x), PeakMemory() as ran:
            outs = run_op(op, fakes, device)
    except Exception:  # noqa: BLE001  (not followable on fake tensors: unknown)
        return None
    ins = [fakes[t] for t in op.inputs]
    storages = [x.untyped_storage()._cdata for x in ins]
    made = [_Made(x.dtype, tuple(x.shape), x.stride(), int(x.storage_offset()),
                  x.untyped_storage().nbytes(),
                  next((j for j, s in enumerate(storages) if s == x.untyped_storage()._cdata),
                       None)) if isinstance(x, torch.Tensor) else None for x in outs]
    if not outs or len(outs) != len(op.outputs):
        return made, None
    return made, replace(_saves(ins, outs, kept), forward_temp=ran.peak - ran.live,
                         backward_temp=_backward_temp(ins, outs))


_PLAIN = (int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype,
          torch.device, torch.layout, torch.memory_format)


def _call(op: Op, given: list[_Value], wanted: list[bool]) -> tuple:
    """What decides a call's outputs and saves: its target and arguments, with each input
    tensor by its position, layout, dtype, whether it wants a gradient and which inputs
    share its storage (other objects by identity)."""
    position = {t: i for i, t in enumerate(op.inputs)}

    def shape(x: Any) -> Any:
        if isinstance(x, PTensor):
            return ("tensor", position[x])
        if isinstance(x, (tuple, list)):
            return (type(x), tuple(shape(y) for y in x))
        if isinstance(x, dict):
            return (dict, tuple((k, shape(v)) for k, v in x.items()))
        if isinstance(x, slice):
            return (slice, shape(x.start), shape(x.stop), shape(x.step))
        return (type(x), x) if isinstance(x, _PLAIN) else ("object", id(x))

    storages = [v.storage for v in given]
    layouts = tuple((v.shape, v.stride, v.offset, v.dtype, v.nbytes, want,
                     storages.index(v.storage)) for v, want in zip(given, wanted))
    return (shape(op.target), shape(op.args), shape(op.kwargs), layouts, len(op.outputs))


def _backward_temp(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> int:
    """The bytes an op's backward makes beyond the gradients it leaves, at most at once."""
    wanted = [x for x in ins if isinstance(x, torch.Tensor) and x.requires_grad]
    given = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    if not wanted or not given:
        return 0
    seeds = [torch.ones_like(o) for o in given]
    try:
        with PeakMemory() as ran:
            made = torch.autograd.grad(given, wanted, seeds, allow_unused=True)
    except Exception:  # noqa: BLE001  (a backward fake tensors cannot follow: none known)
        return 0
    temp = ran.peak - ran.live  # ``made``, the gradients, still alive: left at the end
    del made
    return temp


def _saves(ins: list[torch.Tensor], outs: list[torch.Tensor], kept: list[torch.Tensor]
           ) -> Saves:
    """Which of ``ins`` and ``outs`` the tensors autograd ``kept`` are, which are 16-bit
    copies of an input, and the bytes of the rest (each storage counted once).

    Inputs that share a storage here (a query, key and value split from one projection)
    are each kept by position: a piece of the op may be given them apart (keys and values
    gathered whole for a query chunk), and the memory model counts a storage once by the
    views it follows (``plan/check.py``)."""
    def where(x: torch.Tensor, among: list[torch.Tensor]) -> int | None:
        storage = x.untyped_storage()._cdata
        return next((j for j, y in enumerate(among)
                     if y.untyped_storage()._cdata == storage), None)

    def layout(x: torch.Tensor) -> tuple:
        return (x.untyped_storage()._cdata, x.storage_offset(), tuple(x.shape), x.stride())

    inputs, outputs, cast, other, seen = set(), set(), set(), 0, set()
    for x in kept:
        same = {j for j, y in enumerate(ins) if layout(y) == layout(x)}
        if same:
            inputs |= same
            continue
        if x.untyped_storage()._cdata in seen:
            continue
        seen.add(x.untyped_storage()._cdata)
        if (j := where(x, ins)) is not None:
            inputs.add(j)
        elif (j := where(x, outs)) is not None:
            outputs.add(j)
        elif (j := next((j for j, y in enumerate(ins) if j not in cast and y.numel() == x.numel()
                         and y.dtype == torch.float32 and x.dtype in LOW.values()), None)
              ) is not None:
            cast.add(j)
        else:
            other += x.untyped_storage().nbytes()
    views = tuple((i, j) for i, y in enumerate(outs) if (j := where(y, ins)) is not None)
    return Saves(frozenset(inputs), frozenset(outputs), frozenset(cast), other, views)


def _leaf(t: PTensor, graph: Graph) -> bool:
    return t in graph.inputs or t in graph.params.values() or t in graph.buffers.values() \
        or t.name in graph.constants

