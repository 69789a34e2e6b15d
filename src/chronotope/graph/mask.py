"""Masks: which part of a whole tensor (pTensor) a piece (vTensor) holds.

A mask is one contiguous half-open index range per dim plus a *value range*. Splitting an
op's reduction dim makes each sub-op produce a partial sum ``(i of n)``; the full value is
the sum of all n parts. We model the value part as the interval ``[i/n, (i+1)/n)`` of
``[0, 1)``, so nesting, intersection, containment and "the parts add up to the whole" become
plain interval arithmetic, exactly like the index dims. A mask is thus a box in
``index space x [0, 1)``, and data dependencies between sub-ops are box intersections.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from chronotope.graph.ir import PTensor

__all__ = ["BoxIndex", "Index", "Mask", "VTensor", "ValueRange", "covers_exactly_once"]

Index = tuple[tuple[int, int], ...]
"""(start, stop) per dim, half-open; a 0-dim tensor has the empty tuple."""


@dataclass(frozen=True, slots=True)
class ValueRange:
    """Half-open interval ``[lo, hi)`` of ``[0, 1)``: the share of a value a piece holds.

    ``part(i, n)`` is ``[i/n, (i+1)/n)``; splitting it into m gives ``part(i*m+j, n*m)``
    for free, because the interval arithmetic does the bookkeeping.
    """

    lo: Fraction
    hi: Fraction

    FULL: ClassVar[ValueRange]

    def __post_init__(self) -> None:
        lo, hi = self.lo, self.hi
        if type(lo) is not Fraction or type(hi) is not Fraction:
            lo, hi = Fraction(lo), Fraction(hi)
        if not 0 <= lo < hi <= 1:
            raise ValueError(f"value range must satisfy 0 <= lo < hi <= 1, got [{lo}, {hi})")
        object.__setattr__(self, "lo", lo)
        object.__setattr__(self, "hi", hi)

    def __hash__(self) -> int:  # Fraction's own hash is slow, and masks are hashed a lot
        return hash((self.lo.numerator, self.lo.denominator, self.hi.numerator,
                     self.hi.denominator))

    @classmethod
    def part(cls, i: int, n: int) -> ValueRange:
        """Partial sum number ``i`` of ``n`` (0-based)."""
        if n < 1 or not 0 <= i < n:
            raise ValueError(f"value part must satisfy 0 <= i < n, got part {i} of {n}")
        return cls(Fraction(i, n), Fraction(i + 1, n))

    @property
    def width(self) -> Fraction:
        """Share of the full value this range holds."""
        return _ONE if self is ValueRange.FULL else self.hi - self.lo

    @property
    def is_full(self) -> bool:
        return self is ValueRange.FULL or (self.lo == 0 and self.hi == 1)

    def as_part(self) -> tuple[int, int] | None:
        """``(i, n)`` if this range is exactly ``part(i, n)``, else None."""
        w = self.width
        if w.numerator != 1:
            return None
        n = w.denominator
        i = self.lo * n
        return (int(i), n) if i.denominator == 1 else None

    def intersect(self, other: ValueRange) -> ValueRange | None:
        if other is self or other.is_full:
            return self
        if self.is_full:
            return other
        lo, hi = max(self.lo, other.lo), min(self.hi, other.hi)
        return ValueRange(lo, hi) if lo < hi else None

    def contains(self, other: ValueRange) -> bool:
        return self.lo <= other.lo and other.hi <= self.hi

    def of(self, whole: ValueRange) -> ValueRange:
        """This share of ``whole``: ``part(i, n).of(w)`` is ``w.split(n)[i]``."""
        if self.is_full:
            return whole
        if whole.is_full:
            return self
        return ValueRange(whole.lo + self.lo * whole.width, whole.lo + self.hi * whole.width)

    def split(self, parts: int) -> list[ValueRange]:
        """Cut into ``parts`` equal consecutive ranges (nested partial sums)."""
        if parts < 1:
            raise ValueError(f"cannot split a value range into {parts} parts")
        found = _SPLITS.get((self, parts))
        if found is None:  # few ranges, split again and again: Fractions are slow
            step = self.width / parts
            found = _SPLITS[(self, parts)] = tuple(
                ValueRange(self.lo + k * step, self.lo + (k + 1) * step) for k in range(parts))
        return list(found)

    def __repr__(self) -> str:
        if self.is_full:
            return "V(full)"
        p = self.as_part()
        if p is not None:
            return f"V({p[0]}/{p[1]})"
        return f"V[{self.lo}, {self.hi})"


ValueRange.FULL = ValueRange(Fraction(0), Fraction(1))
_ONE = Fraction(1)
_SPLITS: dict[tuple[ValueRange, int], tuple[ValueRange, ...]] = {}


@dataclass(frozen=True, slots=True)
class Mask:
    """Box ``index x value`` a piece covers inside its whole tensor (global coordinates)."""

    index: Index
    value: ValueRange = field(default=ValueRange.FULL)
    _hash: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if type(self.index) is tuple and all(
                type(r) is tuple and type(r[0]) is int and type(r[1]) is int and 0 <= r[0] <= r[1]
                for r in self.index):
            return  # already normalized (the common case: masks made from masks)
        index = tuple((int(a), int(b)) for a, b in self.index)
        for dim, (a, b) in enumerate(index):
            if not 0 <= a <= b:
                raise ValueError(
                    f"index range of dim {dim} must satisfy 0 <= start <= stop, got {a}:{b}"
                )
        object.__setattr__(self, "index", index)

    def __hash__(self) -> int:  # masks key many dicts: hash once
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((self.index, self.value)))
        return self._hash

    @classmethod
    def full(cls, shape: Sequence[int]) -> Mask:
        """The whole tensor of ``shape`` with its full value."""
        return cls(tuple((0, int(s)) for s in shape), ValueRange.FULL)

    @property
    def ndim(self) -> int:
        return len(self.index)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the piece's own (local) tensor."""
        return tuple(b - a for a, b in self.index)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _check_ndim(self, other: Mask) -> None:
        if self.ndim != other.ndim:
            raise ValueError(f"masks of different ndim cannot be compared: {self} vs {other}")

    def intersect(self, other: Mask) -> Mask | None:
        """The common box, or None when index or value ranges do not overlap."""
        self._check_ndim(other)
        value = self.value.intersect(other.value)
        if value is None:
            return None
        index = []
        for (a, b), (c, d) in zip(self.index, other.index, strict=True):
            lo, hi = max(a, c), min(b, d)
            if lo >= hi:
                return None
            index.append((lo, hi))
        return Mask(tuple(index), value)

    def overlaps(self, other: Mask) -> bool:
        self._check_ndim(other)
        return (all(max(a, c) < min(b, d)
                    for (a, b), (c, d) in zip(self.index, other.index, strict=True))
                and self.value.intersect(other.value) is not None)

    def _index_contains(self, other: Mask) -> bool:
        self._check_ndim(other)
        return all(
            a <= c and d <= b for (a, b), (c, d) in zip(self.index, other.index, strict=True)
        )

    def contains(self, other: Mask) -> bool:
        """True iff every element and value share of ``other`` is in ``self``."""
        return self._index_contains(other) and self.value.contains(other.value)

    def split(self, dim: int, parts: int, count: int | None = None) -> list[Mask]:
        """Even contiguous chunks along ``dim``; sizes that do not divide are refused.
        ``count``: the first ``count`` chunks only."""
        if not -self.ndim <= dim < self.ndim:
            raise ValueError(f"dim {dim} is out of range for a {self.ndim}-dim mask {self}")
        dim %= self.ndim
        start, stop = self.index[dim]
        size = stop - start
        if parts < 1 or size % parts:
            raise ValueError(f"cannot split dim {dim} of size {size} into {parts} equal parts")
        step = size // parts
        out = []
        for k in range(parts if count is None else min(count, parts)):
            index = list(self.index)
            index[dim] = (start + k * step, start + (k + 1) * step)
            out.append(Mask(tuple(index), self.value))
        return out

    def split_value(self, parts: int) -> list[Mask]:
        """Same elements, value cut into ``parts`` partial sums."""
        return [Mask(self.index, v) for v in self.value.split(parts)]

    def to_slices(self) -> tuple[slice, ...]:
        """Where this piece sits in the whole tensor."""
        return tuple(slice(a, b) for a, b in self.index)

    def local_slices(self, within: Mask) -> tuple[slice, ...]:
        """Where this piece sits in the local tensor of the larger piece ``within``.

        Only the index part is checked: slicing cannot select a share of a value, so the
        caller decides whether the value ranges fit (e.g. by intersecting first).
        """
        if not within._index_contains(self):
            raise ValueError(f"mask {self} is not inside {within}")
        return tuple(
            slice(c - a, d - a) for (a, _), (c, d) in zip(within.index, self.index, strict=True)
        )

    def _render(self, full_shape: Sequence[int] | None = None) -> str:
        dims = []
        for dim, (a, b) in enumerate(self.index):
            whole = full_shape is not None and a == 0 and b == full_shape[dim]
            dims.append(":" if whole else f"{a}:{b}")
        text = "[" + ", ".join(dims) + "]"
        return text if self.value.is_full else f"{text} {self.value!r}"

    def __str__(self) -> str:
        return self._render()


class BoxIndex:
    """The index ranges of many pieces of one tensor, to find those a region meets without
    testing every one: pieces are sorted by their start along the dim where starts differ
    most, and a query looks only at starts within one piece's length of it (pieces of one
    tensor are mostly cut alike, so that window holds few)."""

    def __init__(self, indices: Sequence[Index]) -> None:
        self.indices = list(indices)
        ndim = len(self.indices[0]) if self.indices else 0
        self.dim = max(range(ndim), key=lambda d: len({i[d][0] for i in self.indices}),
                       default=None)
        if self.dim is None:
            return
        self.order = sorted(range(len(self.indices)), key=lambda k: self.indices[k][self.dim])
        self.starts = [self.indices[k][self.dim][0] for k in self.order]
        self.longest = max(b - a for a, b in (i[self.dim] for i in self.indices))

    def overlapping(self, index: Index) -> list[int]:
        """Positions (in the order given) of the pieces whose index ranges meet ``index``,
        ascending."""
        if self.dim is None:
            return list(range(len(self.indices)))
        lo, hi = index[self.dim]
        first = bisect_right(self.starts, lo - self.longest)
        last = bisect_left(self.starts, hi)
        return sorted(k for k in self.order[first:last]
                      if all(max(a, c) < min(b, d)
                             for (a, b), (c, d) in zip(self.indices[k], index)))


def equal_runs(whole: Mask, masks: Sequence[Mask]) -> tuple[int, list[int]] | None:
    """Whether ``masks`` are equal runs of ``whole`` along one dim, covering it: that dim,
    and the masks' order along it (None otherwise)."""
    dims = {d for m in masks for d, (a, b) in enumerate(zip(m.index, whole.index)) if a != b}
    if len(dims) != 1:
        return None
    d = dims.pop()
    order = sorted(range(len(masks)), key=lambda i: masks[i].index[d][0])
    lo, hi = whole.index[d]
    size = (hi - lo) // len(masks)
    if [masks[i].index[d] for i in order] != [(lo + k * size, lo + (k + 1) * size)
                                               for k in range(len(masks))]:
        return None
    return d, order


def covers_exactly_once(pieces: Iterable[Mask], shape: Sequence[int]) -> bool:
    """True iff ``pieces`` tile ``shape x [0, 1)`` with no overlap and no gap.

    Exact: boxes inside the bounds that are pairwise disjoint cover the whole space iff
    their volumes (numel x value width, in Fractions) add up to the whole. Disjointness is
    checked with a sweep along the axis with the most distinct starts: a piece is compared
    only with pieces whose range on that axis it meets, not with every other piece.
    """
    shape = tuple(int(s) for s in shape)
    kept: list[Mask] = []
    for m in pieces:
        if m.ndim != len(shape):
            raise ValueError(f"piece {m} has {m.ndim} dims, tensor shape {shape} has {len(shape)}")
        if any(b > s for (_, b), s in zip(m.index, shape, strict=True)):
            return False
        if m.numel:  # an empty piece covers nothing and overlaps nothing
            kept.append(m)

    total = sum((m.numel * m.value.width for m in kept), Fraction(0))
    if total != math.prod(shape):
        return False
    if not kept:
        return True

    # Boxes as (starts..., stops...) over index dims + value axis, the value axis scaled by a
    # common denominator so the overlap test is plain integer comparison.
    denom = math.lcm(
        *(m.value.lo.denominator for m in kept), *(m.value.hi.denominator for m in kept)
    )
    boxes = [
        (
            *(a for a, _ in m.index),
            int(m.value.lo * denom),
            *(b for _, b in m.index),
            int(m.value.hi * denom),
        )
        for m in kept
    ]
    naxes = len(shape) + 1
    axis = max(range(naxes), key=lambda k: len({box[k] for box in boxes}))
    boxes.sort(key=lambda box: box[axis])
    active: list[tuple[int, ...]] = []
    for box in boxes:
        start = box[axis]
        active = [o for o in active if o[naxes + axis] > start]
        for o in active:
            if all(box[k] < o[naxes + k] and o[k] < box[naxes + k] for k in range(naxes)):
                return False
        active.append(box)
    return True


@dataclass(frozen=True, slots=True)
class VTensor:
    """A piece of the whole tensor ``ptensor`` given by ``mask``."""

    ptensor: PTensor
    mask: Mask

    @property
    def shape(self) -> tuple[int, ...]:
        return self.mask.shape

    def overlaps(self, other: VTensor) -> bool:
        """Pieces of different whole tensors never overlap."""
        return self.ptensor == other.ptensor and self.mask.overlaps(other.mask)

    def intersect(self, other: VTensor) -> VTensor | None:
        if self.ptensor != other.ptensor:
            return None
        m = self.mask.intersect(other.mask)
        return None if m is None else VTensor(self.ptensor, m)

    def contains(self, other: VTensor) -> bool:
        return self.ptensor == other.ptensor and self.mask.contains(other.mask)

    def __str__(self) -> str:
        name = getattr(self.ptensor, "name", self.ptensor)
        full_shape = getattr(self.ptensor, "shape", None)
        if full_shape is not None and len(full_shape) != self.mask.ndim:
            full_shape = None
        return f"{name}{self.mask._render(full_shape)}"
