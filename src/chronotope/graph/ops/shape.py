"""Signatures of ops that move data without arithmetic: reshapes, slices, joins."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from chronotope.graph import functional
from chronotope.graph.ir import TensorMeta
from chronotope.graph.ops.pointwise import join, names, pointwise
from chronotope.graph.registry import OpCall, OpRegistry, everywhere, method

aten = torch.ops.aten


def regroup(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of ``src`` dims with runs of ``dst`` dims of equal product.

    ``(2, 8, 16) -> (2, 8, 4, 4)`` gives ``[([0], [0]), ([1], [1]), ([2], [2, 3])]``;
    size-1 dims that appear or vanish form groups with an empty side.
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                gj.append(j)
                pj *= dst[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _refined(src: Sequence[int], dst: Sequence[int]
             ) -> tuple[list[list[int]], list[list[int]]] | None:
    """Factors both groupings of one run of dims are made of, as each axis's run of factor
    numbers: ``(4, 32) -> (16, 8)`` is ``b (h d) -> (b h) d`` (a batch of 4 sharing a
    dim with 4 heads, as attention's ``view(L, B * H, D)``). None when the boundaries of
    one grouping do not divide those of the other."""
    def ends(sizes: Sequence[int]) -> list[int]:
        out, p = [], 1
        for n in sizes:
            p *= n
            out.append(p)
        return out

    bounds = sorted(set(ends(src)) | set(ends(dst)))
    if any(b % a for a, b in zip([1, *bounds], bounds)):
        return None

    def runs(sizes: Sequence[int]) -> list[list[int]]:
        out, at = [], 0
        for end in ends(sizes):
            stop = bounds.index(end) + 1
            out.append(list(range(at, stop)))
            at = stop
        return out

    return runs(src), runs(dst)


def reshape(call: OpCall) -> str | None:
    """Any op whose output is its input with dims merged or split."""
    src, dst = call.tensors[0].shape, call.out.shape
    if any(s == 0 for s in (*src, *dst)):
        return None
    inp: list[str] = [""] * len(src)
    out: list[str] = [""] * len(dst)
    for k, (gi, gj) in enumerate(regroup(src, dst)):
        if not gi or not gj:
            for i in gi:
                inp[i] = "1"
            for j in gj:
                out[j] = "1"
        elif len(gi) == 1 or len(gj) == 1:
            many, one = (gj, gi) if len(gi) == 1 else (gi, gj)
            fac = [f"g{k}_{n}" for n in range(len(many))]
            group = "(" + " ".join(fac) + ")" if len(many) > 1 else fac[0]
            side_one, side_many = (inp, out) if len(gi) == 1 else (out, inp)
            side_one[one[0]] = group
            for n, idx in enumerate(many):
                side_many[idx] = fac[n]
        else:
            found = _refined([src[i] for i in gi], [dst[j] for j in gj])
            if found is None:  # an irregular regrouping: nothing can be split
                for n, i in enumerate(gi):
                    inp[i] = f"g{k}_i{n}^"
                for n, j in enumerate(gj):
                    out[j] = f"g{k}_o{n}^"
                continue
            for side, idx, runs in ((inp, gi, found[0]), (out, gj, found[1])):
                for axis, run in zip(idx, runs):
                    fac = [f"g{k}_{n}" for n in run]
                    side[axis] = fac[0] if len(fac) == 1 else "(" + " ".join(fac) + ")"
    extra = [names(len(t.shape), "x") for t in call.tensors[1:]]  # view_as/reshape_as
    return f"{join(inp, *extra)} -> {' '.join(out)}"


def permute(call: OpCall) -> str:
    x = call.tensors[0]
    n = len(x.shape)
    rest = call.args[1:]
    dims = rest[0] if len(rest) == 1 and isinstance(rest[0], Sequence) else rest
    dims = call.kwargs.get("dims", dims)
    inp = names(n)
    return f"{' '.join(inp)} -> {' '.join(inp[d % n] for d in dims)}"


def transpose(call: OpCall) -> str:
    x = call.tensors[0]
    n = len(x.shape)
    inp = names(n)
    if n < 2:
        return f"{' '.join(inp)} -> {' '.join(inp)}"
    a, b = (call.arg(1, "dim0", 0) % n, call.arg(2, "dim1", 1) % n)
    out = list(inp)
    out[a], out[b] = out[b], out[a]
    return f"{' '.join(inp)} -> {' '.join(out)}"


def matrix_t(call: OpCall) -> str:
    n = len(call.tensors[0].shape)
    inp = names(n)
    return f"{' '.join(inp)} -> {' '.join(inp[::-1])}"


def expand(call: OpCall) -> str:
    """expand / expand_as / broadcast_to: size-1 dims grow, leading dims appear."""
    x, out = call.tensors[0].shape, call.out.shape
    onames = names(len(out))
    offset = len(out) - len(x)
    inp = ["1" if s == 1 and out[offset + j] != 1 else onames[offset + j]
           for j, s in enumerate(x)]
    extra = [onames[len(out) - len(t.shape):] for t in call.tensors[1:]]
    return f"{join(inp, *extra)} -> {' '.join(onames)}"


def repeat_interleave(call: OpCall) -> str:
    """``x.repeat_interleave(r, dim)`` with an int ``r``: element ``i`` becomes rows
    ``i*r .. i*r+r-1``, so the output dim is ``(i r)`` and ``i`` still splits."""
    x = call.tensors[0]
    r, d = call.arg(1, "repeats"), call.arg(2, "dim")
    if len(call.tensors) > 1 or not isinstance(r, int) or d is None:
        return repeat(call)
    n = len(x.shape)
    d %= n
    inp = names(n)
    out = list(inp)
    out[d] = f"({inp[d]} {r})"
    return f"{' '.join(inp)} -> {' '.join(out)}"


def repeat(call: OpCall) -> str:
    """repeat / tile / repeat_interleave: repeated dims are frozen."""
    x, out = call.tensors[0].shape, call.out.shape
    offset = len(out) - len(x)
    inp, outn = [], []
    for j in range(len(out)):
        if j < offset:
            outn.append(f"r{j}^")
        elif x[j - offset] == out[j]:
            inp.append(f"d{j}")
            outn.append(f"d{j}")
        else:
            inp.append(f"i{j}^")
            outn.append(f"r{j}^")
    extra = [names(len(t.shape), "k") for t in call.tensors[1:]]
    extra = [[d + "^" for d in e] for e in extra]
    return f"{join(inp, *extra)} -> {' '.join(outn)}"


def _dim(call: OpCall, index: int, ndim: int, default: int = 0) -> int:
    return int(call.arg(index, "dim", default)) % ndim


def concat(call: OpCall) -> str:
    """cat: the joined dim is frozen and sized per input; the rest are shared. An empty 1-D
    input (an empty cache's start) is skipped, as ``torch.cat`` skips it."""
    ts = call.tensors
    n = len(call.out.shape)
    d = _dim(call, 1, n)
    items = []
    for k, t in enumerate(ts):
        if t.shape == (0,) and n != 1:
            items.append(["0"])
            continue
        dims = names(n)
        dims[d] = f"c{k}^"
        items.append(dims)
    out = names(n)
    out[d] = "c^"
    return f"{join(*items)} -> {' '.join(out)}"


def stack(call: OpCall) -> str:
    ts = call.tensors
    n = len(call.out.shape)
    d = _dim(call, 1, n)
    inp = names(n - 1)
    out = list(inp)
    out.insert(d, str(len(ts)))
    return f"{join(*[inp] * len(ts))} -> {' '.join(out)}"


def split(call: OpCall) -> str:
    """split / chunk / unbind / tensor_split: each piece has its own frozen size."""
    x = call.tensors[0]
    n = len(x.shape)
    d = _dim(call, 2, n)
    inp = names(n)
    inp[d] = "s^"
    outs = []
    for k, o in enumerate(call.outputs):
        dims = names(n)
        if len(o.shape) == n:
            dims[d] = f"p{k}^"
        else:
            del dims[d]
        outs.append(dims)
    return f"{' '.join(inp)} -> {join(*outs)}"


def unbind(call: OpCall) -> str:
    x = call.tensors[0]
    n = len(x.shape)
    d = _dim(call, 1, n)
    inp = names(n)
    inp[d] = "s^"
    out = names(n)
    del out[d]
    return f"{' '.join(inp)} -> " + ", ".join(" ".join(out) for _ in call.outputs)


def _is_full(s: slice, size: int) -> bool:
    return (
        s.start in (None, 0)
        and (s.stop is None or (isinstance(s.stop, int) and s.stop >= size))
        and s.step in (None, 1)
    )


def _index_items(call: OpCall) -> list[object] | None:
    """``x[index]``'s items with ``...`` and missing trailing dims written out as ``:``,
    one per dim of ``x`` (plus the ``None``s that add dims); None for a bad index."""
    index = call.arg(1, "index")
    items = list(index) if isinstance(index, tuple) else [index]
    n = len(call.tensors[0].shape)
    explicit = sum(1 for it in items if it is not None and it is not Ellipsis)
    if sum(1 for it in items if it is Ellipsis) > 1 or explicit > n:
        return None
    expanded: list[object] = []
    for it in items:
        expanded.extend([slice(None)] * (n - explicit) if it is Ellipsis else [it])
    expanded.extend([slice(None)] * (n - sum(1 for it in expanded if it is not None)))
    return expanded


def getitem(call: OpCall) -> str | None:
    """Basic indexing plus integer tensor indices (broadcast together, as in NumPy)."""
    x = call.tensors[0]
    expanded = _index_items(call)
    if expanded is None:
        return None
    tensor_at = [i for i, it in enumerate(expanded) if hasattr(it, "shape")]
    if any(expanded[i].dtype == torch.bool for i in tensor_at):
        return None  # a mask index: the result's size depends on the values
    batch = torch.broadcast_shapes(*(expanded[i].shape for i in tensor_at)) if tensor_at else ()
    bnames = names(len(batch), "t")
    adjacent = tensor_at == list(range(tensor_at[0], tensor_at[-1] + 1)) if tensor_at else True
    inp: list[str] = []
    out: list[str] = [] if adjacent else list(bnames)
    extra: list[list[str]] = []
    d = 0
    for pos, it in enumerate(expanded):
        if it is None:
            out.append("1")
            continue
        size = x.shape[d]
        if isinstance(it, slice):
            if any(hasattr(v, "shape") for v in (it.start, it.stop, it.step)):
                return None
            if _is_full(it, size):
                inp.append(f"d{d}")
                out.append(f"d{d}")
            else:
                inp.append(f"i{d}^")
                out.append(f"o{d}^")
        elif isinstance(it, int):
            inp.append(f"i{d}^")
        elif isinstance(it, list) and not tensor_at and all(isinstance(v, int) for v in it) \
                and sum(isinstance(e, list) for e in expanded) == 1:
            inp.append(f"i{d}^")  # picks rows, as a slice would (x[..., [-2], :])
            out.append(f"o{d}^")
        elif hasattr(it, "shape"):
            inp.append(f"i{d}^")
            offset = len(batch) - len(it.shape)
            extra.append(["1" if s == 1 and batch[offset + j] != 1 else bnames[offset + j]
                          for j, s in enumerate(it.shape)])
            if adjacent and pos == tensor_at[0]:
                out.extend(bnames)
        else:
            return None
        d += 1
    return f"{join(inp, *extra)} -> {' '.join(out)}"


def attribute(call: OpCall) -> str | None:
    """``x.T`` and ``x.mT`` (read as attributes): transposes."""
    n = len(call.tensors[0].shape)
    dims = names(n)
    if call.arg(1, "name") == "T":
        return f"{' '.join(dims)} -> {' '.join(reversed(dims))}"
    if call.arg(1, "name") == "mT" and n >= 2:
        return f"{' '.join(dims)} -> {' '.join([*dims[:-2], dims[-1], dims[-2]])}"
    return None


def diff(call: OpCall) -> str:
    """``torch.diff``: neighbours along one dim are subtracted, so that dim is frozen."""
    n = len(call.tensors[0].shape)
    d = _dim(call, 2, n, default=-1)
    inp = [f"i{i}^" if i == d else f"d{i}" for i in range(n)]
    extra = [[f"x{k}_{i}^" if i == d else f"d{i}" for i in range(n)]
             for k in range(len(call.tensors) - 1)]  # prepend / append
    out = [f"o{i}^" if i == d else f"d{i}" for i in range(n)]
    return f"{join(inp, *extra)} -> {' '.join(out)}"


def setitem(call: OpCall) -> str:
    """``x[idx] = v`` made functional. With basic indexing (ints, slices, None), a dim the
    index takes whole (``:``) splits, and ``v`` (broadcast to ``x[idx]``) with it; the
    dims the index cuts are frozen. Any other index freezes every dim."""
    x = call.tensors[0]
    expanded = _index_items(call)
    if expanded is None or not all(it is None or isinstance(it, (int, slice))
                                   for it in expanded):
        return _frozen_setitem(call)
    dims: list[str] = []
    region: list[tuple[str, int]] = []  # the dims of x[idx], with their sizes
    d = 0
    for it in expanded:
        if it is None:
            region.append(("1", 1))
            continue
        size = x.shape[d]
        if isinstance(it, slice) and _is_full(it, size):
            dims.append(f"d{d}")
            region.append((f"d{d}", size))
        elif isinstance(it, slice):
            if any(v is not None and not isinstance(v, int) for v in (it.start, it.stop, it.step)):
                return _frozen_setitem(call)
            dims.append(f"x{d}^")
            region.append((f"r{d}^", len(range(*it.indices(size)))))
        else:
            dims.append(f"x{d}^")
        d += 1
    values = []
    for t in call.tensors[1:]:
        offset = len(region) - len(t.shape)
        if offset < 0:
            return _frozen_setitem(call)
        values.append(["1" if s == 1 and region[offset + j][1] != 1 else region[offset + j][0]
                       for j, s in enumerate(t.shape)])
    return f"{join(dims, *values)} -> {' '.join(dims)}"


def _frozen_setitem(call: OpCall) -> str:
    dims = [f"d{i}^" for i in range(len(call.tensors[0].shape))]
    others = [[f"v{k}_{i}^" for i in range(len(t.shape))] for k, t in enumerate(call.tensors[1:])]
    return f"{join(dims, *others)} -> {' '.join(dims)}"


def updated(call: OpCall) -> str | None:
    """An in-place method made functional: elementwise updates broadcast like pointwise ops."""
    if call.args[1] not in functional.ELEMENTWISE_UPDATES:
        return None
    return pointwise(call)


def along_dims(dims_index: int, name: str = "dims"):
    """roll / flip: the listed dims are frozen (all of them when none are listed)."""

    def rule(call: OpCall) -> str:
        x = call.tensors[0]
        n = len(x.shape)
        raw = call.arg(dims_index, name)
        chosen = set(range(n)) if raw in (None, (), []) else {
            d % n for d in ([raw] if isinstance(raw, int) else raw)
        }
        inp = [f"d{i}^" if i in chosen else f"d{i}" for i in range(n)]
        return f"{' '.join(inp)} -> {' '.join(inp)}"

    return rule


def last_two_frozen(call: OpCall) -> str:
    n = len(call.tensors[0].shape)
    dims = [f"d{i}^" if i >= n - 2 else f"d{i}" for i in range(n)]
    return f"{' '.join(dims)} -> {' '.join(dims)}"


def aten_slice(call: OpCall) -> str:
    x = call.tensors[0]
    n = len(x.shape)
    d = int(call.arg(1, "dim", 0)) % n
    if x.shape[d] == call.out.shape[d]:
        dims = names(n)
        return f"{' '.join(dims)} -> {' '.join(dims)}"
    inp = [f"i{i}^" if i == d else f"d{i}" for i in range(n)]
    out = [f"o{i}^" if i == d else f"d{i}" for i in range(n)]
    return f"{' '.join(inp)} -> {' '.join(out)}"


def aten_select(call: OpCall) -> str:
    x = call.tensors[0]
    n = len(x.shape)
    d = int(call.arg(1, "dim", 0)) % n
    inp = [f"i{i}^" if i == d else f"d{i}" for i in range(n)]
    out = [f"d{i}" for i in range(n) if i != d]
    return f"{' '.join(inp)} -> {' '.join(out)}"


def scatter(call: OpCall) -> str:
    """``slice_scatter`` / ``select_scatter``: ``src`` is written into one dim of ``x``."""
    x, src = call.tensors[:2]
    n = len(x.shape)
    d = _dim(call, 2, n)
    xin = [f"x{i}^" if i == d else f"d{i}" for i in range(n)]
    if len(src.shape) == n:
        srcd = [f"s{i}^" if i == d else f"d{i}" for i in range(n)]
    else:
        srcd = [f"d{i}" for i in range(n) if i != d]
    return f"{join(xin, srcd)} -> {' '.join(xin)}"


def aten_index(call: OpCall) -> str | None:
    indices = call.arg(1, "indices")
    return getitem(OpCall((call.args[0], tuple(slice(None) if i is None else i for i in indices)),
                          {}, call.outputs))


Region = tuple[tuple[int, int], ...]


def _box(x: TensorMeta, axes: dict[int, tuple[int, int]]) -> Region:
    return tuple(axes.get(i, (0, n)) for i, n in enumerate(x.shape))


def narrow_region(call: OpCall) -> tuple[Region, str] | None:
    """``narrow``: reads one contiguous run of a dim; every dim stays splittable."""
    x = call.tensors[0]
    n = len(x.shape)
    d = _dim(call, 1, n)
    start, length = call.arg(2, "start"), call.arg(3, "length")
    if not isinstance(start, int) or not isinstance(length, int) or length < 1:
        return None
    start %= x.shape[d]
    dims = " ".join(names(n))
    return _box(x, {d: (start, start + length)}), f"{dims} -> {dims}"


def select_region(call: OpCall) -> tuple[Region, str] | None:
    """``select`` (and ``unbind``'s pieces): reads one index of a dim, which disappears."""
    x = call.tensors[0]
    n = len(x.shape)
    d = _dim(call, 1, n)
    index = call.arg(2, "index")
    if not isinstance(index, int):
        return None
    index %= x.shape[d]
    inp = names(n)
    inp[d] = "1"
    out = [a for i, a in enumerate(inp) if i != d]
    return _box(x, {d: (index, index + 1)}), f"{' '.join(inp)} -> {' '.join(out)}"


def slice_region(call: OpCall) -> tuple[Region, str] | None:
    """``aten.slice`` with step 1."""
    x = call.tensors[0]
    n = len(x.shape)
    d = int(call.arg(1, "dim", 0)) % n
    start, stop, step = call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", 1)
    if any(v is not None and not isinstance(v, int) for v in (start, stop)) or step != 1:
        return None
    lo, hi, _ = slice(start, stop).indices(x.shape[d])
    if hi <= lo:
        return None
    dims = " ".join(names(n))
    return _box(x, {d: (lo, hi)}), f"{dims} -> {dims}"


def getitem_region(call: OpCall) -> tuple[Region, str] | None:
    """Basic indexing (ints, step-1 slices, None, ...): the box it reads, all dims splittable."""
    x = call.tensors[0]
    n = len(x.shape)
    expanded = _index_items(call)
    if expanded is None or not all(it is None or isinstance(it, (int, slice))
                                   for it in expanded):
        return None
    axes: dict[int, tuple[int, int]] = {}
    inp, out = names(n), []
    d = 0
    for it in expanded:
        if it is None:
            out.append("1")
            continue
        size = x.shape[d]
        if isinstance(it, int):
            if not -size <= it < size:
                return None
            axes[d] = (it % size, it % size + 1)
            inp[d] = "1"
        else:
            if any(v is not None and not isinstance(v, int) for v in (it.start, it.stop, it.step)):
                return None
            lo, hi, step = it.indices(size)
            if step != 1 or hi <= lo:
                return None
            axes[d] = (lo, hi)
            out.append(inp[d])
        d += 1
    return _box(x, axes), f"{' '.join(inp)} -> {' '.join(out)}"


def narrow(call: OpCall) -> str:
    x = call.tensors[0]
    n = len(x.shape)
    d = _dim(call, 1, n)
    inp = [f"i{i}^" if i == d else f"d{i}" for i in range(n)]
    out = [f"o{i}^" if i == d else f"d{i}" for i in range(n)]
    return f"{' '.join(inp)} -> {' '.join(out)}"


def pad(call: OpCall) -> str:
    x = call.tensors[0]
    n = len(x.shape)
    widths = call.arg(1, "pad")
    padded = {n - 1 - k // 2 for k in range(len(widths)) if widths[k]}
    inp = [f"i{i}^" if i in padded else f"d{i}" for i in range(n)]
    out = [f"o{i}^" if i in padded else f"d{i}" for i in range(n)]
    return f"{' '.join(inp)} -> {' '.join(out)}"


def as_complex(call: OpCall) -> str:
    """``view_as_complex``: each trailing pair of reals one complex number."""
    dims = names(len(call.tensors[0].shape) - 1)
    return f"{' '.join(dims)} 2 -> {' '.join(dims)}"


def as_real(call: OpCall) -> str:
    """``view_as_real``: each complex number a trailing pair of reals."""
    dims = names(len(call.tensors[0].shape))
    return f"{' '.join(dims)} -> {' '.join(dims)} 2"


def register(reg: OpRegistry) -> None:
    reg.add(everywhere("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze",
                     "view_as", "reshape_as", "_unsafe_view", "ravel"), "reshape", reshape)
    reg.add(everywhere("permute"), "permute", permute)
    reg.add(everywhere("view_as_complex"), "view_as_complex", as_complex)
    reg.add(everywhere("view_as_real"), "view_as_real", as_real)
    reg.add(everywhere("transpose", "swapaxes", "swapdims"), "transpose", transpose)
    reg.add(everywhere("t"), "transpose", matrix_t)
    reg.add(everywhere("expand", "expand_as", "broadcast_to"), "expand", expand)
    reg.add(everywhere("repeat", "tile"), "repeat", repeat)
    reg.add(everywhere("repeat_interleave"), "repeat", repeat_interleave)
    reg.add([torch.cat, torch.concat, torch.concatenate, aten.cat], "cat", concat)
    reg.add([torch.stack, aten.stack], "stack", stack)
    reg.add(everywhere("split", "chunk", "tensor_split", "split_with_sizes"), "split", split)
    reg.add(everywhere("unbind"), "unbind", unbind)
    reg.add([operator.getitem, *method("__getitem__")], "getitem", getitem,
            region=getitem_region)
    reg.add([operator.setitem, functional.setitem], "setitem", setitem)
    reg.add([getattr], "transpose", attribute)
    reg.add([functional.updated], "update", updated)
    reg.add(everywhere("roll"), "roll", along_dims(2))
    reg.add(everywhere("diff"), "diff", diff)
    reg.add(everywhere("flip"), "flip", along_dims(1))
    reg.add(everywhere("tril", "triu"), "triangle", last_two_frozen)
    reg.add(everywhere("narrow"), "narrow", narrow, region=narrow_region)
    reg.add([torch.nn.functional.pad, torch._C._nn.pad, aten.pad, aten.constant_pad_nd], "pad", pad)
    reg.add([aten.slice], "slice", aten_slice, region=slice_region)
    reg.add(everywhere("select"), "select", aten_select, region=select_region)
    reg.add([aten.slice_scatter, aten.select_scatter], "setitem", scatter)
    reg.add([aten.index], "getitem", aten_index)
