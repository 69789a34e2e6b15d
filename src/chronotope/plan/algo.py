"""Partition algorithms, derived from an op's signature.

``Split(dim, parts)`` cuts a named dim of the signature: every tensor that has
it is sliced alike; when the dim is a reduction (``k+``) the outputs become
value-split partial sums. ``ValueSplit(parts)`` cuts an op along the values
of the inputs it is linear in (a loss's sum divided by its count): each piece
takes a value share of them and makes that share of the output, so per
micro-batch losses need no whole sum. ``Replicate(n)`` makes ``n`` identical copies whose
backward pieces are replicas too: each yields the whole gradient, so a reader
uses the one on its own device. Each piece also records which share of every
input's gradient its backward produces: an input a split piece reads whole (it
lacks the split dim) gets a partial gradient; an input it reads a value share of
(a bias under a reduction split, a linear input under ``ValueSplit``) gets the
whole gradient, since the gradient of an addend is the gradient of the sum.
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


@dataclass(frozen=True)
class ValueSplit:
    """Cut the op into ``parts`` along the values of the inputs it is linear in (or of
    ``inputs``, those of them it takes shares of: one factor of a product)."""

    parts: int
    inputs: tuple[int, ...] = ()


Algorithm = Split | Replicate | ValueSplit


@dataclass(frozen=True)
class Piece:
    """What one sub-op covers: its tensors' masks, gradient shares and dim sizes."""

    inputs: tuple[VTensor, ...]
    outputs: tuple[VTensor, ...]
    grad_shares: tuple[ValueRange, ...]
    sizes: dict[str, int]


def _axis_of(sig_tensor: tuple, dim: str, sizes: dict[str, int]) -> int | None:
    """The tensor axis that carries ``dim``: as a plain axis, a group's leading factor, or
    a factor after ones (``sizes``), where a slice of it is a slice of the axis."""
    for a, axis in enumerate(sig_tensor):
        for i, f in enumerate(axis.factors):
            if f.name == dim and f.size is None:
                return a if all(sizes.get(g.name, g.size) == 1 for g in axis.factors[:i]) \
                    else None
    return None


def partition(name: str, sig: Signature | None, piece: Piece, algo: Algorithm,
              additive: tuple[int, ...] = (), linear: tuple[int, ...] = (),
              count: int | None = None) -> list[Piece]:
    """The pieces ``algo`` cuts ``piece`` (a whole op or a sub-op named ``name``) into.

    ``additive`` lists inputs that enter the output as a sum (a linear's bias):
    under a reduction split each partial takes a value share of them. ``linear``
    lists the inputs the op is jointly linear in, for ``ValueSplit``. ``count``: make
    the first ``count`` pieces only (a template keeps one of a thousand micro-batches).
    """
    if isinstance(algo, Replicate):
        if algo.n < 1:
            raise PlanError(f"{name}: Replicate needs n >= 1, got {algo.n}")
        return [piece] * (algo.n if count is None else min(count, algo.n))
    if isinstance(algo, ValueSplit):
        return _whole_integers(name, algo,
                               _value_split(name, piece, algo.parts, linear)[:count])
    if not isinstance(algo, Split):
        raise PlanError(f"{name}: unknown algorithm {algo!r}; use ct.Split, ct.ValueSplit or "
                        "ct.Replicate")
    if sig is None:
        raise PlanError(f"{name} has no signature, so it can only be replicated (ct.Replicate); "
                        "register one with @chronotope.register_op to split it")
    if algo.dim not in sig.names():
        raise PlanError(f"{name}: its signature '{sig}' has no dim {algo.dim!r}; "
                        f"dims: {', '.join(sig.names())}")
    splittable = sig.splittable(piece.sizes)
    if algo.dim not in splittable:
        why = "frozen (^)" if sig.dim(algo.dim).frozen else \
            "a trailing factor of a merged dim (split the factors before it to one element first)"
        raise PlanError(f"{name}: dim {algo.dim!r} of '{sig}' is {why} and cannot be split; "
                        f"splittable dims: {', '.join(splittable) or 'none'}")
    size = piece.sizes[algo.dim]
    if algo.parts < 1 or size % algo.parts:
        raise PlanError(f"{name}: dim {algo.dim!r} has size {size} here, which does not split "
                        f"into {algo.parts} equal parts")
    reduce = sig.dim(algo.dim).reduce
    sizes = {**piece.sizes, algo.dim: size // algo.parts}
    n = algo.parts
    k = n if count is None else min(count, n)  # the pieces made
    ins, shares = [], []  # per input: its pieces' reads and gradient shares (cut once)
    for j, (v, s, dims) in enumerate(zip(piece.inputs, piece.grad_shares, sig.inputs)):
        a = _axis_of(dims, algo.dim, piece.sizes)
        if a is not None:
            ins.append([VTensor(v.ptensor, m) for m in v.mask.split(a, n, k)])
            shares.append([s] * k)
        elif reduce and j in additive:  # a value share: its gradient is the whole's
            ins.append([VTensor(v.ptensor, m) for m in v.mask.split_value(n)[:k]])
            shares.append([s] * k)
        else:
            ins.append([v] * k)  # read whole by every piece: its gradient becomes partial
            shares.append(s.split(n)[:k])
    outs = []
    for v, dims in zip(piece.outputs, sig.outputs):
        a = _axis_of(dims, algo.dim, piece.sizes)
        if a is not None:
            outs.append([VTensor(v.ptensor, m) for m in v.mask.split(a, n, k)])
        elif reduce:
            outs.append([VTensor(v.ptensor, Mask(v.mask.index, r))
                         for r in v.mask.value.split(n)[:k]])
        else:
            outs.append([v] * k)  # every piece computes this output whole
    pieces = [Piece(tuple(x[i] for x in ins), tuple(x[i] for x in outs),
                    tuple(x[i] for x in shares), sizes) for i in range(k)]
    return _whole_integers(name, algo, pieces)


def _whole_integers(name: str, algo: Algorithm, pieces: list[Piece]) -> list[Piece]:
    """``pieces``, unless one holds a value share of an integer or boolean tensor: a share
    of an index or a mask is no index or mask (and ``x * 0.5`` is no longer an integer)."""
    for v in (v for p in pieces for v in (*p.inputs, *p.outputs)):
        if not v.mask.value.is_full and not v.ptensor.dtype.is_floating_point:
            raise PlanError(f"{name}: {algo} would cut {v.ptensor.name} ({v.ptensor.dtype}) "
                            "into value shares, which an integer tensor cannot hold; split "
                            "a dim it has, or replicate the op")
    return pieces


def _value_split(name: str, piece: Piece, parts: int, linear: tuple[int, ...]) -> list[Piece]:
    """Piece k reads value share k of the ``linear`` inputs (the rest whole) and makes share
    k of each output. Its backward yields the whole gradient of a linear input (as a
    replica) and share k of the others'."""
    if not linear:
        raise PlanError(f"{name} is not registered as linear in any input, so it cannot be "
                        "cut along values (ct.ValueSplit); use ct.Split or ct.Replicate")
    if parts < 1:
        raise PlanError(f"{name}: ValueSplit needs parts >= 1, got {parts}")
    ins = [[VTensor(v.ptensor, m) for m in v.mask.split_value(parts)] if j in linear
           else [v] * parts for j, v in enumerate(piece.inputs)]
    shares = [[s] * parts if j in linear else s.split(parts)
              for j, s in enumerate(piece.grad_shares)]
    outs = [[VTensor(v.ptensor, Mask(v.mask.index, r)) for r in v.mask.value.split(parts)]
            for v in piece.outputs]
    return [Piece(tuple(x[k] for x in ins), tuple(x[k] for x in outs),
                  tuple(x[k] for x in shares), piece.sizes) for k in range(parts)]
