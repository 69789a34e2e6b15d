"""Partition algorithms, derived from an op's signature.

``Split(dim, parts)`` cuts a named dim of the signature: every tensor that has
it is sliced alike; when the dim is a reduction (``k+``) the outputs become
value-split partial sums. ``Replicate(n)`` makes ``n`` identical copies whose
backward pieces are replicas too: each yields the whole gradient, so a reader
uses the one on its own device. Each piece also records which share of every
input's gradient its backward produces: an input a split piece reads whole (it
lacks the split dim) gets a partial gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from chronotope.errors import PlanError
from chronotope.graph.mask import Mask, ValueRange, VTensor
from chronotope.graph.signature import Signature


@dataclass(frozen=True)
class Split:
    """Cut dim ``dim`` of the op's signature into ``parts`` equal pieces."""

    dim: str
    parts: int


@dataclass(frozen=True)
class Replicate:
    """``n`` copies of the op, each computing the whole of it."""

    n: int


Algorithm = Split | Replicate


@dataclass(frozen=True)
class Piece:
    """What one sub-op covers: its tensors' masks, gradient shares and dim sizes."""

    inputs: tuple[VTensor, ...]
    outputs: tuple[VTensor, ...]
    grad_shares: tuple[ValueRange, ...]
    sizes: dict[str, int]


def _axis_of(sig_tensor: tuple, dim: str) -> int | None:
    """The tensor axis that carries ``dim`` (as a plain axis or a group's leading factor)."""
    for a, axis in enumerate(sig_tensor):
        if axis.factors[0].name == dim and axis.factors[0].size is None:
            return a
    return None


def partition(name: str, sig: Signature | None, piece: Piece, algo: Algorithm,
              additive: tuple[int, ...] = ()) -> list[Piece]:
    """The pieces ``algo`` cuts ``piece`` (a whole op or a sub-op named ``name``) into.

    ``additive`` lists inputs that enter the output as a sum (a linear's bias):
    under a reduction split each partial takes a value share of them.
    """
    if isinstance(algo, Replicate):
        if algo.n < 1:
            raise PlanError(f"{name}: Replicate needs n >= 1, got {algo.n}")
        return [piece] * algo.n
    if not isinstance(algo, Split):
        raise PlanError(f"{name}: unknown algorithm {algo!r}; use ct.Split or ct.Replicate")
    if sig is None:
        raise PlanError(f"{name} has no signature, so it can only be replicated (ct.Replicate); "
                        "register one with @chronotope.register_op to split it")
    if algo.dim not in sig.names():
        raise PlanError(f"{name}: its signature '{sig}' has no dim {algo.dim!r}; "
                        f"dims: {', '.join(sig.names())}")
    if algo.dim not in sig.splittable():
        why = "frozen (^)" if sig.dim(algo.dim).frozen else "a trailing factor of a merged dim"
        raise PlanError(f"{name}: dim {algo.dim!r} of '{sig}' is {why} and cannot be split; "
                        f"splittable dims: {', '.join(sig.splittable()) or 'none'}")
    size = piece.sizes[algo.dim]
    if algo.parts < 1 or size % algo.parts:
        raise PlanError(f"{name}: dim {algo.dim!r} has size {size} here, which does not split "
                        f"into {algo.parts} equal parts")
    reduce = sig.dim(algo.dim).reduce
    sizes = {**piece.sizes, algo.dim: size // algo.parts}
    pieces = []
    for i in range(algo.parts):
        inputs, shares = [], []
        for j, (v, s, dims) in enumerate(zip(piece.inputs, piece.grad_shares, sig.inputs)):
            a = _axis_of(dims, algo.dim)
            if a is not None:
                inputs.append(VTensor(v.ptensor, v.mask.split(a, algo.parts)[i]))
                shares.append(s)
            elif reduce and j in additive:
                inputs.append(VTensor(v.ptensor, v.mask.split_value(algo.parts)[i]))
                shares.append(s.split(algo.parts)[i])
            else:
                inputs.append(v)  # read whole by every piece: its gradient becomes partial
                shares.append(s.split(algo.parts)[i])
        outputs = []
        for v, dims in zip(piece.outputs, sig.outputs):
            a = _axis_of(dims, algo.dim)
            if a is not None:
                outputs.append(VTensor(v.ptensor, v.mask.split(a, algo.parts)[i]))
            elif reduce:
                outputs.append(VTensor(v.ptensor, Mask(v.mask.index,
                                                       v.mask.value.split(algo.parts)[i])))
            else:
                outputs.append(v)  # every piece computes this output whole
        pieces.append(Piece(tuple(inputs), tuple(outputs), tuple(shares), sizes))
    return pieces
