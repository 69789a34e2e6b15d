"""RVD: a tensor's layout over devices as replicas, value parts and dim splits.

``R(r) V(v) D(d1..dn)`` over ``r * v * d1 * .. * dn`` devices: the tensor is cut
into ``d_i`` equal runs along dim ``i``, each run into ``v`` parts whose sum is
the value, and each of those is held by ``r`` devices. A ``Layout`` is an RVD
and the devices in its canonical order: device ``k`` holds the piece of ``k``
written in mixed radix ``(r, v, d1, .., dn)``, the last digit fastest. It
converts to and from the pieces (``VTensor`` masks) the compiler works with, and
to and from ``torch.distributed.tensor`` placements on a device mesh (Replicate,
Partial, Shard per mesh axis), so layouts compare with DTensor's and can
describe checkpoints.

One mesh axis's placement is written as DTensor prints it, ``"R"`` (Replicate),
``"P"`` (Partial: a sum) or ``"S(d)"`` (Shard(d)): the search's strategies say per
mesh axis how each tensor is held in these words, and ``placement`` makes the
DTensor placement of each.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chronotope.errors import PlanError
from chronotope.graph.mask import Mask, ValueRange

if TYPE_CHECKING:  # torch.distributed.tensor takes half a second to import: on demand
    from torch.distributed.tensor import Placement


REPLICATE, PARTIAL = "R", "P"  # one mesh axis's placement (with ``shard(dim)``)
_NO_PLACEMENT = "{code!r} is no placement: R, P or S(<dim>)"


def shard(dim: int) -> str:
    """The placement of a tensor cut along ``dim`` over a mesh axis: Shard(dim)."""
    return f"S({dim})"


def is_shard(code: str) -> bool:
    return code[:1] == "S"


def shard_dim(code: str) -> int | None:
    """The dim a placement cuts (``"S(1)"``: 1); None for Replicate and Partial. A
    malformed shard code (``"Sx"``, ``"S(a)"``) is refused, named."""
    if not is_shard(code):
        return None
    if not (code[1:2] == "(" and code[2:-1].isdigit() and code[-1] == ")"):
        raise PlanError(_NO_PLACEMENT.format(code=code))
    return int(code[2:-1])


def placement(code: str) -> Placement:
    """The DTensor placement a code names."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if code == REPLICATE:
        return Replicate()
    if code == PARTIAL:
        return Partial()
    dim = shard_dim(code)
    if dim is None:
        raise PlanError(_NO_PLACEMENT.format(code=code))
    return Shard(dim)


def placement_code(p: Placement) -> str:
    """A DTensor placement's code (``Shard(1)``: ``"S(1)"``)."""
    from torch.distributed.tensor import Shard

    if isinstance(p, Shard):
        return shard(p.dim)
    if p.is_replicate() or p.is_partial():
        return REPLICATE if p.is_replicate() else PARTIAL
    raise PlanError(f"placement {p} is none of Replicate, Partial and Shard")


@dataclass(frozen=True)
class RVD:
    r: int
    v: int
    d: tuple[int, ...]

    @property
    def ndevices(self) -> int:
        return self.r * self.v * math.prod(self.d)

    @property
    def radix(self) -> tuple[int, ...]:
        return (self.r, self.v, *self.d)

    def __str__(self) -> str:
        return f"R({self.r})V({self.v})D({','.join(map(str, self.d))})"


@dataclass(frozen=True)
class Layout:
    """An RVD and the devices holding its pieces, in canonical order."""

    rvd: RVD
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.devices) != self.rvd.ndevices:
            raise PlanError(f"{self.rvd} needs {self.rvd.ndevices} devices, got "
                            f"{len(self.devices)}: {list(self.devices)}")

    def moved(self, by: int) -> Layout:
        """The same layout on devices ``by`` further on."""
        return Layout(self.rvd, tuple(d + by for d in self.devices))

    def pieces(self, shape: tuple[int, ...]) -> list[tuple[int, Mask]]:
        """(device, piece) for every device, as the compiler's masks."""
        if len(self.rvd.d) != len(shape):
            raise PlanError(f"{self.rvd} splits {len(self.rvd.d)} dims; the tensor has "
                            f"{len(shape)}: {list(shape)}")
        for n, k in zip(shape, self.rvd.d):
            if n % k:
                raise PlanError(f"{self.rvd} cuts a dim of {n} into {k} parts, which do not "
                                f"divide it (shape {list(shape)})")
        out = []
        for device, (_, vi, *di) in zip(self.devices, itertools.product(
                *(range(x) for x in self.rvd.radix))):
            index = tuple((i * n // k, (i + 1) * n // k) for i, n, k in zip(di, shape, self.rvd.d))
            out.append((device, Mask(index, ValueRange.part(vi, self.rvd.v))))
        return out

    @staticmethod
    def of(pieces: list[tuple[int, Mask]], shape: tuple[int, ...]) -> Layout | None:
        """The layout these (device, piece) pairs are, or None when they are not one."""
        if not pieces:
            return None
        first = pieces[0][1]
        d = tuple(n // (hi - lo) if hi > lo and n % (hi - lo) == 0 else 0
                  for (lo, hi), n in zip(first.index, shape))
        v = round(1 / float(first.value.width)) if first.value.width else 0
        if 0 in d or v == 0 or len(pieces) % (v * math.prod(d)):
            return None
        rvd = RVD(len(pieces) // (v * math.prod(d)), v, d)
        held: dict[tuple, list[int]] = {}
        for device, mask in pieces:
            held.setdefault((mask.index, mask.value.lo, mask.value.hi), []).append(device)
        devices = []
        for key in _canonical_keys(rvd, shape):  # replica 0's slots, then replica 1's, ...
            if not held.get(key):
                return None
            devices.append(held[key].pop(0))
        if any(held.values()):
            return None
        return Layout(rvd, tuple(devices))

    # ---- DTensor placements ------------------------------------------------------------------

    def placements(self) -> tuple[tuple[int, ...], tuple[Placement, ...], tuple[int, ...]]:
        """A device mesh (its shape, its devices in row-major order) and the placement of
        each of its axes that make this layout: Replicate for R, Partial for V, Shard(i)
        for the splits of dim i. Axes of size 1 are left out."""
        axes = [(self.rvd.r, REPLICATE), (self.rvd.v, PARTIAL),
                *((k, shard(i)) for i, k in enumerate(self.rvd.d))]
        kept = [(n, p) for n, p in axes if n > 1] or [(1, REPLICATE)]
        return tuple(n for n, _ in kept), tuple(placement(p) for _, p in kept), self.devices

    @staticmethod
    def from_placements(mesh_shape: tuple[int, ...], placements: tuple[Placement, ...],
                        mesh_devices: tuple[int, ...], ndim: int) -> Layout:
        """The layout of a tensor with ``ndim`` dims placed on a device mesh as DTensor
        places it (``mesh_devices`` in row-major order). Several axes sharding one dim
        nest left to right, as DTensor's do."""
        if len(mesh_shape) != len(placements):
            raise PlanError(f"a mesh of shape {list(mesh_shape)} needs {len(mesh_shape)} "
                            f"placements, got {len(placements)}")
        codes = [placement_code(p) for p in placements]
        r = math.prod(n for n, c in zip(mesh_shape, codes) if c == REPLICATE)
        v = math.prod(n for n, c in zip(mesh_shape, codes) if c == PARTIAL)
        d = [1] * ndim
        for n, code, p in zip(mesh_shape, codes, placements):
            if (dim := shard_dim(code)) is not None:
                if not 0 <= dim < ndim:
                    raise PlanError(f"{p} on a tensor of {ndim} dims")
                d[dim] *= n
        rvd = RVD(r, v, tuple(d))
        slots = [0] * rvd.ndevices
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            digits = [0] * (2 + ndim)  # (r, v, d1..dn) of this mesh coordinate
            sizes = [1] * (2 + ndim)  # how much of each digit the axes so far made
            for at, n, code in zip(coord, mesh_shape, codes):
                cut = shard_dim(code)
                slot = 2 + cut if cut is not None else 1 if code == PARTIAL else 0
                digits[slot] = digits[slot] * n + at
                sizes[slot] *= n
            flat = 0
            for digit, size in zip(digits, rvd.radix):
                flat = flat * size + digit
            slots[flat] = mesh_devices[_row_major(coord, mesh_shape)]
        return Layout(rvd, tuple(slots))


def _row_major(coord: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for c, n in zip(coord, shape):
        flat = flat * n + c
    return flat


def _canonical_keys(rvd: RVD, shape: tuple[int, ...]) -> list[tuple]:
    """The piece of each canonical slot, as (index, value lo, value hi)."""
    keys = []
    for _, vi, *di in itertools.product(*(range(x) for x in rvd.radix)):
        index = tuple((i * n // k, (i + 1) * n // k) for i, n, k in zip(di, shape, rvd.d))
        value = ValueRange.part(vi, rvd.v)
        keys.append((index, value.lo, value.hi))
    return keys
