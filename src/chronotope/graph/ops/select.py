"""Signatures of ops that pick, order, count or place elements by value or by index:
topk, sort, kthvalue, median, cummax, searchsorted, histc, gather, scatter, index_select,
index_add, index_put.

An index along one dim points anywhere in that dim, so the indexed dim of the
tensor read (or written) is frozen. The other dims line up between the tensor,
the index and the result, and split together where their sizes agree. A sum of
contributions (scatter_add, index_add, accumulating index_put) splits along the
contributions: each piece adds its share, and the tensor added to is additive.
"""

from __future__ import annotations

import torch

from chronotope.graph.ops.pointwise import join, names
from chronotope.graph.registry import OpCall, OpRegistry, everywhere

aten = torch.ops.aten


def _dim(call: OpCall, index: int, ndim: int, default: int | None = None) -> int:
    return int(call.arg(index, "dim", default)) % max(ndim, 1)


def ordered(dim_index: int, default: int | None):
    """topk / sort / argsort: values are compared along one dim, which is frozen; every
    output (values, indices) keeps the other dims."""

    def rule(call: OpCall) -> str | None:
        x = call.tensors[0]
        n = len(x.shape)
        if n == 0:
            return None
        d = _dim(call, dim_index, n, default)
        inp = [f"s{i}^" if i == d else f"d{i}" for i in range(n)]
        outs = [[f"o{i}^" if i == d else f"d{i}" for i in range(n)] for _ in call.outputs]
        return f"{' '.join(inp)} -> {join(*outs)}"

    return rule


def picked(dim_index: int, keepdim_index: int, default: int | None):
    """kthvalue / median / mode: one element picked along a dim (which is frozen, and
    dropped unless ``keepdim``); without a dim, of all elements (one output)."""

    def rule(call: OpCall) -> str | None:
        x = call.tensors[0]
        n = len(x.shape)
        dim = call.arg(dim_index, "dim", default)
        if dim is None or n == 0:
            return f"{' '.join(f'd{i}^' for i in range(n)) or '()'} -> "
        d = int(dim) % n
        keep = bool(call.arg(keepdim_index, "keepdim", False))
        inp = [f"s{i}^" if i == d else f"d{i}" for i in range(n)]
        out = [("1" if keep else "") if i == d else f"d{i}" for i in range(n)]
        out_s = " ".join(o for o in out if o)
        return f"{' '.join(inp)} -> " + ", ".join(out_s for _ in call.outputs)

    return rule


def searchsorted(values_first: bool):
    """searchsorted / bucketize: each value's position among sorted boundaries, which are
    read whole along their last dim; a value's dims (and shared leading dims) split."""

    def rule(call: OpCall) -> str | None:
        if len(call.tensors) < 2:
            return None
        bounds, values = call.tensors[1::-1] if values_first else call.tensors[:2]
        lead = len(bounds.shape) - 1
        if lead and bounds.shape[:-1] != values.shape[:-1]:
            return None
        vs = names(len(values.shape))
        bs = [*vs[:lead], "m^"]
        ins = [vs, bs] if values_first else [bs, vs]
        return f"{join(*ins)} -> {' '.join(vs)}"

    return rule


def histc(call: OpCall) -> str | None:
    """Counts in fixed bins: the counts of a slice add up to the whole's, but only when
    the range is given (``min < max``); otherwise it comes from the values themselves."""
    lo, hi = call.arg(2, "min", 0), call.arg(3, "max", 0)
    if not lo < hi:
        return None
    dims = [f"{d}+" for d in names(len(call.tensors[0].shape))]
    return f"{' '.join(dims) or '()'} -> h^"


def _lined_up(x_shape: tuple[int, ...], other: tuple[int, ...], d: int, x_dim: str,
              other_dim: str, other_prefix: str) -> tuple[list[str], list[str]]:
    """Dims of a tensor indexed along ``d`` and of an index-shaped tensor: dim ``d`` gets its
    own names; any other dim is shared where the sizes agree and frozen where the index is
    shorter (it then reads only a prefix)."""
    xs, os_ = [], []
    for i, (a, b) in enumerate(zip(x_shape, other)):
        if i == d:
            xs.append(x_dim)
            os_.append(other_dim)
        elif a == b:
            xs.append(f"d{i}")
            os_.append(f"d{i}")
        else:
            xs.append(f"x{i}^")
            os_.append(f"{other_prefix}{i}^")
    return xs, os_


def gather(call: OpCall) -> str | None:
    """``out[..., j, ...] = x[..., index[..., j, ...], ...]`` along ``dim``."""
    x, idx = call.tensors[:2]
    n = len(x.shape)
    if n == 0 or len(idx.shape) != n:
        return None
    xs, ids = _lined_up(x.shape, idx.shape, _dim(call, 1, n), "g^", "o", "e")
    return f"{join(xs, ids)} -> {' '.join(ids)}"


def scatter(added: bool):
    """``scatter`` / ``scatter_add`` / ``scatter_reduce``: ``src`` placed into a copy of
    ``x`` at ``index`` along ``dim``. With ``added`` (a sum), the index's dim along
    ``dim`` is a reduction over contributions; otherwise later writes win, so it is frozen."""

    def rule(call: OpCall) -> str | None:
        x, idx, *src = call.tensors
        n = len(x.shape)
        if n == 0 or len(idx.shape) != n or any(len(s.shape) != n for s in src):
            return None
        if src and src[0].shape != idx.shape:
            return _frozen(call)  # a larger src is read only in its leading block
        summed = added or call.arg(4, "reduce") == "sum" and call.arg(5, "include_self", True)
        xs, ids = _lined_up(x.shape, idx.shape, _dim(call, 1, n), "x^", "i+" if summed else "i^",
                            "e")
        return f"{join(xs, ids, *(ids for _ in src))} -> {' '.join(xs)}"

    return rule


def _frozen(call: OpCall) -> str:
    """Every dim of every tensor frozen: the op runs whole, yet its shapes are known."""
    ins = [[f"i{k}_{i}^" for i in range(len(t.shape))] for k, t in enumerate(call.tensors)]
    outs = [[f"o{k}_{i}^" for i in range(len(t.shape))] for k, t in enumerate(call.outputs)]
    return f"{join(*ins)} -> {join(*outs)}"


def index_select(call: OpCall) -> str | None:
    """Whole slices of ``x`` along ``dim`` picked by a 1-D index."""
    x, idx = call.tensors[:2]
    n = len(x.shape)
    if n == 0 or len(idx.shape) != 1:
        return None
    d = _dim(call, 1, n)
    xin = ["g^" if i == d else f"d{i}" for i in range(n)]
    out = ["t0" if i == d else f"d{i}" for i in range(n)]
    return f"{join(xin, ['t0'])} -> {' '.join(out)}"


def index_add(call: OpCall) -> str | None:
    """``x`` plus ``source``'s slices added at ``index`` along ``dim``: a sum over the index."""
    x, idx, src = call.tensors[:3]
    n = len(x.shape)
    if n == 0 or len(idx.shape) != 1 or len(src.shape) != n:
        return None
    d = _dim(call, 1, n)
    xin = ["x^" if i == d else f"d{i}" for i in range(n)]
    sin = ["t0+" if i == d else f"d{i}" for i in range(n)]
    return f"{join(xin, ['t0+'], sin)} -> {' '.join(xin)}"


def index_put(call: OpCall) -> str | None:
    """``x[i0, i1, ...] = values`` (``+=`` with ``accumulate``) for integer index tensors on
    the leading dims: those dims are frozen, the rest line up with ``values``' trailing dims;
    the indices' (broadcast) dims are a sum over contributions when accumulating."""
    x = call.tensors[0]
    indices = call.arg(1, "indices")
    if not isinstance(indices, (tuple, list)) or not indices or any(
            not hasattr(i, "shape") or i.dtype == torch.bool for i in indices):
        return None
    values = call.tensors[-1]
    k, n = len(indices), len(x.shape)
    batch = torch.broadcast_shapes(*(i.shape for i in indices))
    rest = x.shape[k:]
    t = "+" if call.arg(3, "accumulate", False) else "^"
    bnames, rnames = [f"{d}{t}" for d in names(len(batch), "t")], names(n - k, "r")
    full = [*bnames, *rnames]
    shape = (*batch, *rest)
    offset = len(shape) - len(values.shape)
    if offset < 0:
        return None
    vals = ["1" if s == 1 and shape[offset + j] != 1 else full[offset + j]
            for j, s in enumerate(values.shape)]
    xs = [*(f"x{i}^" for i in range(k)), *rnames]
    idx = [[("1" if s == 1 and batch[len(batch) - len(i.shape) + j] != 1
             else bnames[len(batch) - len(i.shape) + j]) for j, s in enumerate(i.shape)]
           for i in indices]
    return f"{join(xs, *idx, vals)} -> {' '.join(xs)}"


def register(reg: OpRegistry) -> None:
    reg.add(everywhere("topk"), "topk", ordered(2, -1))
    reg.add(everywhere("sort"), "sort", ordered(1, -1))
    reg.add(everywhere("argsort"), "argsort", ordered(1, -1))
    reg.add(everywhere("cummax", "cummin", "logcumsumexp"), "cumulative", ordered(1, None))
    reg.add(everywhere("kthvalue"), "kthvalue", picked(2, 3, -1))
    reg.add(everywhere("median", "nanmedian", "mode"), "median", picked(1, 2, None))
    reg.add([torch.searchsorted, aten.searchsorted], "searchsorted", searchsorted(False))
    reg.add([torch.bucketize, aten.bucketize], "bucketize", searchsorted(True))
    reg.add(everywhere("histc"), "histc", histc)
    reg.add(everywhere("gather"), "gather", gather)
    reg.add(everywhere("scatter"), "scatter", scatter(added=False))
    reg.add(everywhere("scatter_add"), "scatter_add", scatter(added=True), additive_inputs=(0,))
    reg.add(everywhere("scatter_reduce"), "scatter_reduce", scatter(added=False),
            additive_inputs=(0,))
    reg.add(everywhere("index_select"), "index_select", index_select)
    reg.add(everywhere("index_add"), "index_add", index_add, additive_inputs=(0,))
    reg.add(everywhere("index_put"), "index_put", index_put, additive_inputs=(0,))
