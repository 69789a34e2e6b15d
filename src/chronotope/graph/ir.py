"""The operator graph: whole tensors (pTensors) and the ops between them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch

from chronotope.graph.signature import Signature

if TYPE_CHECKING:
    from chronotope.graph.registry import OpRegistry


def takes_grad(dtype: torch.dtype) -> bool:
    """Whether autograd differentiates through a tensor of ``dtype``: floating point and
    complex (rotary embeddings written as complex products) alike."""
    return dtype.is_floating_point or dtype.is_complex


def fresh_name(base: str, taken: set[str], sep: str = "_") -> str:
    """``base``, or ``base{sep}1``, ``base{sep}2``, ... : the first not in ``taken``
    (which gets it)."""
    name, i = base, 1
    while name in taken:
        name, i = f"{base}{sep}{i}", i + 1
    taken.add(name)
    return name


# Kinds of op whose outputs carry no gradient back to their inputs: what they make depends
# on the inputs' shapes, or is made without autograd (``detach``, ``torch.no_grad()``).
NO_GRAD_KINDS = frozenset({
    "detach", "factory", "fill", "argmax", "argmin", "one_hot", "zeros_like", "ones_like",
    "full_like", "empty_like", "rand_like", "randn_like", "random",
})


class TensorKind(StrEnum):
    INPUT = "input"  # a batch input of the training step
    PARAM = "param"
    BUFFER = "buffer"
    CONSTANT = "constant"  # a tensor attribute that is neither parameter nor buffer
    ACTIVATION = "activation"  # produced by an op


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclass(eq=False)
class PTensor:
    """A whole logical tensor; identity is the object (names are for people)."""

    name: str
    meta: TensorMeta
    kind: TensorKind
    producer: Op | None = None
    # A parameter the model keeps fixed (``requires_grad=False``): it gets no gradient, no
    # optimizer state and no communication for either.
    frozen: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.dtype

    def __repr__(self) -> str:
        return f"PTensor({self.name}: {self.meta}, {self.kind})"


class _Device:
    """Stands for 'the device the graph runs on' in captured op arguments."""

    _instance: _Device | None = None

    def __new__(cls) -> _Device:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DEVICE"

    def __reduce__(self) -> str:
        return "DEVICE"


DEVICE = _Device()


@dataclass(frozen=True)
class Source:
    """Where an op came from in the user's code."""

    file: str
    line: int
    function: str
    module: str  # module path, e.g. "layers.3.attn"; "" for the top level

    def __str__(self) -> str:
        where = f"{self.file}:{self.line} in {self.function}"
        return f"{where} ({self.module})" if self.module else where


@dataclass(eq=False)
class Op:
    """One operator call. ``args``/``kwargs`` hold PTensors where tensors go.

    ``target`` is what runs it: a callable, or a method name called on the
    first argument.
    """

    name: str
    kind: str
    target: Callable[..., Any] | str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: tuple[PTensor, ...]
    outputs: tuple[PTensor, ...]
    signature: Signature | None = None
    source: Source | None = None
    note: str = ""  # why the op has no signature, when it has none
    # For slicing ops: the box of the first input they read, per axis (lo, hi); the
    # signature is over that box, so a piece of the op reads a piece of the box.
    region: tuple[tuple[int, int], ...] | None = None

    @property
    def input_shapes(self) -> list[tuple[int, ...]]:
        """The shapes the signature describes: the inputs, the first cut to ``region``."""
        shapes = [t.shape for t in self.inputs]
        if self.region is not None:
            shapes[0] = tuple(hi - lo for lo, hi in self.region)
        return shapes

    @property
    def annotated(self) -> bool:
        return self.signature is not None

    def __repr__(self) -> str:
        return f"Op({self.name}: {self.kind})"


@dataclass(eq=False)
class Graph:
    """A captured training step: ops in topological order ending in the loss."""

    ops: list[Op]
    inputs: list[PTensor]  # batch inputs, in call order
    params: dict[str, PTensor]
    buffers: dict[str, PTensor]
    constants: dict[str, torch.Tensor]  # CONSTANT pTensor name -> value
    loss: PTensor
    # Buffers the step changes (running statistics), by name: their values after it.
    buffer_updates: dict[str, PTensor] = field(default_factory=dict)
    input_names: list[str] = field(default_factory=list)  # argument names, for binding
    name: str = "model"
    frontend: str = "fx"
    # The registry the graph was captured with: plans look its ops' signatures up there.
    registry: OpRegistry | None = field(default=None, repr=False, compare=False)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def op(self, name: str) -> Op:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"graph {self.name!r} has no op named {name!r}")

    def unannotated_ops(self) -> list[Op]:
        """Ops without a signature: they can only be replicated."""
        return [op for op in self.ops if not op.annotated]

    def trainable(self) -> list[PTensor]:
        """The parameters training updates: floating point and not frozen."""
        return [t for t in self.params.values() if t.dtype.is_floating_point and not t.frozen]

    @property
    def num_params(self) -> int:
        return sum(p.meta.numel for p in self.params.values())

    @property
    def batch_size(self) -> int:
        """Samples in the example batch: the leading dim most batch inputs share, the first
        input's among equals (0 without inputs). An input led by another size (the flat
        ids of an ``EmbeddingBag`` beside its per-bag offsets) is not samples."""
        sizes = [t.shape[0] for t in self.inputs if t.shape]
        return max(sizes, key=lambda n: (sizes.count(n), -sizes.index(n))) if sizes else 0

    def batched_inputs(self) -> list[PTensor]:
        """The inputs whose leading dim is the batch's samples."""
        n = self.batch_size
        return [t for t in self.inputs if t.shape and t.shape[0] == n]

    def consumers(self) -> dict[PTensor, list[Op]]:
        users: dict[PTensor, list[Op]] = {}
        for op in self.ops:
            for t in op.inputs:
                users.setdefault(t, []).append(op)
        return users

    def __str__(self) -> str:
        lines = [
            f"Graph {self.name}: {len(self.ops)} ops, {self.num_params:,} parameters "
            f"({len(self.params)} tensors), captured with {self.frontend}"
        ]
        for t in self.inputs:
            lines.append(f"  input  {t.name}: {t.meta}")
        for op in self.ops:
            ins = ", ".join(t.name for t in op.inputs)
            outs = ", ".join(f"{t.name}: {t.meta}" for t in op.outputs)
            sig = str(op.signature) if op.signature else "replicate-only"
            where = f"  # {op.source.file.rsplit('/', 1)[-1]}:{op.source.line}" if op.source else ""
            lines.append(f"  {outs} = {op.kind}({ins})  [{sig}]{where}")
        lines.append(f"  loss   {self.loss.name}")
        lines += [f"  buffer {name} = {t.name}" for name, t in self.buffer_updates.items()]
        return "\n".join(lines)
