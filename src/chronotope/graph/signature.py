"""Op signatures: einops-like strings that name every tensor dim of an op.

``"b s k+, n k+ -> b s n"`` says a linear's inputs and output share ``b``, ``s``
and ``n``, and that ``k`` is reduced. From the names follow shape inference and
the legal partitions:

* a plain dim may be split; every tensor that has it is split alike;
* ``k+``: a reduction dim; splitting it leaves each sub-op with a partial sum of
  the output (a value split);
* ``d^``: a frozen dim that is never split (softmax axis, normalized dims);
* ``(h d)``: one tensor dim made of several named factors (reshapes); only the
  leading factor may be split, since a slice of any other is not contiguous, unless
  the factors before it are cut to one element;
* ``1`` or any integer: a dim of that fixed size, never split.

An empty item between commas, or ``()``, is a 0-dim tensor; nothing after ``->``
is one scalar output, nothing before it an op without tensor inputs (``-> a b``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from chronotope.errors import SignatureError

_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_]*[+^]?|\d+")


@dataclass(frozen=True)
class Dim:
    """One named dim (or a fixed-size literal when ``size`` is set)."""

    name: str
    reduce: bool = False
    frozen: bool = False
    size: int | None = None

    @property
    def splittable(self) -> bool:
        return not self.frozen and self.size is None

    def __str__(self) -> str:
        if self.size is not None:
            return str(self.size)
        return self.name + ("+" if self.reduce else "^" if self.frozen else "")


@dataclass(frozen=True)
class Axis:
    """One tensor dim: a single named dim or a group of factors ``(h d)``."""

    factors: tuple[Dim, ...]

    @property
    def grouped(self) -> bool:
        return len(self.factors) > 1

    def __str__(self) -> str:
        inner = " ".join(str(f) for f in self.factors)
        return f"({inner})" if self.grouped else inner


TensorDims = tuple[Axis, ...]


@dataclass(frozen=True)
class Signature:
    """Parsed signature: one ``TensorDims`` per tensor input and output."""

    inputs: tuple[TensorDims, ...]
    outputs: tuple[TensorDims, ...]

    @staticmethod
    def parse(text: str) -> Signature:
        if "->" not in text:
            raise SignatureError(f"signature {text!r} has no '->'")
        lhs, rhs = text.split("->", 1)
        # Every op has an output: an empty right side is one scalar.
        sig = Signature(_parse_side(lhs, text), _parse_side(rhs, text) or ((),))
        sig._check_markers(text)
        return sig

    def _check_markers(self, text: str) -> None:
        seen: dict[str, Dim] = {}
        for dim in self.dims():
            if dim.size is not None:
                continue
            first = seen.setdefault(dim.name, dim)
            if (first.reduce, first.frozen) != (dim.reduce, dim.frozen):
                raise SignatureError(
                    f"signature {text!r}: dim {dim.name!r} is marked differently "
                    f"where it appears ({first} vs {dim})"
                )
        out_names = {d.name for t in self.outputs for a in t for d in a.factors}
        for name, dim in seen.items():
            if dim.reduce and name in out_names:
                raise SignatureError(
                    f"signature {text!r}: reduction dim {name!r} also appears in an output"
                )

    def dims(self) -> list[Dim]:
        """Every dim occurrence, inputs first, in order."""
        return [d for t in (*self.inputs, *self.outputs) for a in t for d in a.factors]

    def dim(self, name: str) -> Dim:
        for d in self.dims():
            if d.name == name and d.size is None:
                return d
        raise KeyError(name)

    def names(self) -> list[str]:
        """Distinct dim names in order of first appearance."""
        out: dict[str, None] = {}
        for d in self.dims():
            if d.size is None:
                out.setdefault(d.name)
        return list(out)

    def splittable(self, sizes: dict[str, int] | None = None) -> list[str]:
        """Names of the dims a partition may split (see the module docstring). Given the
        dims' ``sizes`` in a piece, a trailing factor of a group splits too where every
        factor before it has one element there: ``(b t)`` of one sample is its ``t``."""
        blocked = {
            f.name
            for t in (*self.inputs, *self.outputs)
            for a in t
            for i, f in enumerate(a.factors)
            if i > 0 and not (sizes is not None and _ones(a.factors[:i], sizes))
        }
        return [n for n in self.names() if self.dim(n).splittable and n not in blocked]

    def bind(
        self, input_shapes: Sequence[Sequence[int]], output_shapes: Sequence[Sequence[int]]
    ) -> dict[str, int]:
        """Sizes of every named dim; raises ``SignatureError`` on any mismatch."""
        if len(input_shapes) != len(self.inputs) or len(output_shapes) != len(self.outputs):
            raise SignatureError(
                f"signature '{self}' names {len(self.inputs)} inputs and {len(self.outputs)} "
                f"outputs, the op has {len(input_shapes)} and {len(output_shapes)} tensors"
            )
        sizes: dict[str, int] = {}
        pending: list[tuple[Axis, int, str]] = []
        pairs = [*zip(self.inputs, input_shapes), *zip(self.outputs, output_shapes)]
        for k, (dims, shape) in enumerate(pairs):
            where = f"input {k}" if k < len(self.inputs) else f"output {k - len(self.inputs)}"
            if len(dims) != len(shape):
                raise SignatureError(
                    f"signature '{self}': {where} has shape {tuple(shape)} "
                    f"({len(shape)} dims) but the signature names {len(dims)}"
                )
            for axis, size in zip(dims, shape):
                if not axis.grouped:
                    _set_size(sizes, axis.factors[0], size, self, where)
                else:
                    pending.append((axis, size, where))
        # Groups: each factor's size comes from elsewhere, except at most one per group.
        for _ in range(len(pending) + 1):
            progress = False
            for axis, size, where in pending:
                unknown = [f for f in axis.factors if f.size is None and f.name not in sizes]
                known = 1
                for f in axis.factors:
                    if f.size is not None or f.name in sizes:
                        known *= f.size if f.size is not None else sizes[f.name]
                if len(unknown) == 1 and known and size % known == 0:
                    sizes[unknown[0].name] = size // known
                    progress = True
                elif not unknown and known != size:
                    raise SignatureError(
                        f"signature '{self}': {where} dim {axis} has size {size}, "
                        f"its factors multiply to {known}"
                    )
            if not progress:
                break
        missing = [n for n in self.names() if n not in sizes]
        if missing:
            raise SignatureError(f"signature '{self}': cannot infer the size of {missing}")
        return sizes

    def output_shapes(self, input_shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """Shape inference: output shapes from input shapes, when inputs name every dim."""
        sizes = Signature(self.inputs, ()).bind(input_shapes, [])
        shapes = []
        for t in self.outputs:
            shape = []
            for axis in t:
                size = 1
                for f in axis.factors:
                    if f.size is None and f.name not in sizes:
                        raise SignatureError(
                            f"signature '{self}': output dim {f.name!r} appears in no input, "
                            "so its size cannot be inferred"
                        )
                    size *= f.size if f.size is not None else sizes[f.name]
                shape.append(size)
            shapes.append(tuple(shape))
        return shapes

    def __str__(self) -> str:
        def side(ts: tuple[TensorDims, ...]) -> str:
            return ", ".join(" ".join(str(a) for a in t) for t in ts)

        lhs = "()" if self.inputs == ((),) else side(self.inputs)  # one 0-dim input
        return f"{lhs} -> {side(self.outputs)}".strip()


def _ones(factors: Sequence[Dim], sizes: dict[str, int]) -> bool:
    """Whether each of ``factors`` has one element (by ``sizes``, or its fixed size)."""
    return all((f.size if f.size is not None else sizes.get(f.name)) == 1 for f in factors)


def _set_size(sizes: dict[str, int], dim: Dim, size: int, sig: Signature, where: str) -> None:
    if dim.size is not None:
        if dim.size != size:
            raise SignatureError(
                f"signature '{sig}': {where} has size {size} where the signature fixes {dim.size}"
            )
        return
    old = sizes.setdefault(dim.name, size)
    if old != size:
        raise SignatureError(
            f"signature '{sig}': dim {dim.name!r} is {old} in one tensor and {size} in {where}"
        )


def _parse_side(side: str, text: str) -> tuple[TensorDims, ...]:
    items = side.split(",")
    if len(items) == 1 and not items[0].strip():
        return ()
    return tuple(() if item.strip() == "()" else _parse_tensor(item, text) for item in items)


def _parse_tensor(item: str, text: str) -> TensorDims:
    stripped = re.sub(r"\s+", "", item)
    if _TOKEN.sub("", stripped):
        raise SignatureError(f"signature {text!r}: cannot parse {item.strip()!r}")
    axes: list[Axis] = []
    group: list[Dim] | None = None
    for tok in _TOKEN.findall(item):
        if tok == "(":
            if group is not None:
                raise SignatureError(f"signature {text!r}: nested groups are not allowed")
            group = []
        elif tok == ")":
            if not group:
                raise SignatureError(f"signature {text!r}: empty or unopened group")
            axes.append(Axis(tuple(group)))
            group = None
        else:
            dim = _parse_dim(tok)
            if group is not None:
                group.append(dim)
            else:
                axes.append(Axis((dim,)))
    if group is not None:
        raise SignatureError(f"signature {text!r}: unclosed group")
    return tuple(axes)


def _parse_dim(tok: str) -> Dim:
    if tok.isdigit():
        return Dim(tok, size=int(tok))
    if tok.endswith("+"):
        return Dim(tok[:-1], reduce=True)
    if tok.endswith("^"):
        return Dim(tok[:-1], frozen=True)
    return Dim(tok)
