"""Following one tensor axis through the graph by signatures.

A policy marks where an axis starts (the batch on inputs' axis 0, the
sequence on axis 1, a column-split linear's features); each op that reads a
marked axis names it with a signature dim, and that dim marks the output axes
it reaches. ``(b t)`` after a flatten keeps ``b`` as its leading factor, so the
batch survives reshapes; a reduced dim (``k+``) ends the trail, and so does an op
that reads the axis but cannot split it (no signature, or a frozen dim).
"""

from __future__ import annotations

from dataclasses import dataclass

from chronotope.graph.ir import Graph, Op, PTensor, TensorKind
from chronotope.graph.registry import OpRegistry
from chronotope.graph.signature import Dim, Signature

# Ops that take only the shape, dtype or device of their tensor inputs (``x.new_zeros``).
SHAPE_ONLY = frozenset({"fill", "factory"})


def carried_dim(op: Op, axis: dict[PTensor, int]) -> str | None:
    """The splittable signature dim of ``op`` that one of its inputs' marked axes carries."""
    sig = op.signature
    if sig is None:
        return None
    for t, tdims in zip(op.inputs, sig.inputs):
        a = axis.get(t)
        if a is None or a >= len(tdims):
            continue
        lead = tdims[a].factors[0]
        if lead.size is None and lead.name in sig.splittable():
            return lead.name
    return None


def carry(op: Op, dim: str, axis: dict[PTensor, int]) -> None:
    """Mark the output axes that ``dim`` (as a plain axis or a leading factor) reaches."""
    for t, tdims in zip(op.outputs, op.signature.outputs):
        for a, ax in enumerate(tdims):
            if ax.factors[0].name == dim:
                axis[t] = a
                break


def trail(graph: Graph, start: dict[PTensor, int]
          ) -> tuple[dict[Op, str | None], dict[Op, str]]:
    """For each op, the signature dim that carries the axes marked in ``start``; and the ops
    where the trail is lost without a reduction: they read a marked axis (of more than one
    element) but no splittable dim carries it, with why."""
    axis = dict(start)
    dims: dict[Op, str | None] = {}
    lost: dict[Op, str] = {}
    for op in graph.ops:
        dims[op] = carried_dim(op, axis)
        if dims[op] is not None:
            carry(op, dims[op], axis)
        elif op.kind not in SHAPE_ONLY and any(t in axis and t.shape[axis[t]] > 1
                                                for t in op.inputs):
            lost[op] = "no signature" if op.signature is None else \
                "its signature cannot split that dim"
    return dims, lost


def follow(graph: Graph, start: dict[PTensor, int]) -> dict[Op, str | None]:
    """For each op, the signature dim that carries the axes marked in ``start``."""
    return trail(graph, start)[0]


def batch_start(graph: Graph) -> dict[PTensor, int]:
    """Where the batch starts: axis 0 of every batch input."""
    return {t: 0 for t in graph.batched_inputs()}


def batch_dims(graph: Graph) -> dict[Op, str | None]:
    """For each op, the dim that carries the batch (axis 0 of every batch input)."""
    return follow(graph, batch_start(graph))


def sequence_dims(graph: Graph) -> dict[Op, str | None]:
    """For each op, the dim that carries the sequence (axis 1 of the batch inputs)."""
    return follow(graph, {t: 1 for t in graph.inputs if len(t.shape) >= 2})


def loss_tails(graph: Graph, batch_dim: dict[Op, str | None], registry: OpRegistry
               ) -> dict[Op, tuple[int, ...]]:
    """Ops without a batch dim that are linear in a batch reduction's partial sums (a mean
    loss's sum divided by its count, a learned weight times it), with the inputs they are
    linear in: cut along those values, one piece per micro-batch, the rest read whole. A
    smooth function of the sums that is not linear in them (``exp(mean)``) is no tail."""
    made_by = {t: op for op in graph.ops for t in op.outputs}
    tails: dict[Op, tuple[int, ...]] = {}
    for op in graph.ops:
        opdef = registry.of(op.target)
        if batch_dim[op] is not None or opdef is None:
            continue
        summed = {j for j, t in enumerate(op.inputs)
                  if (p := made_by.get(t)) is not None and (batch_dim[p] is not None or p in tails)}
        sets = [s for s in opdef.value_splits(len(op.inputs)) if summed & set(s)]
        if sets:  # what it is linear in, all of the sums where it can be
            tails[op] = next((s for s in sets if summed <= set(s)), sets[0])
    return tails


@dataclass(frozen=True)
class SeqCut:
    """How an op's pieces follow the sequence (context parallelism): along its dim ``dim``,
    which holds sequences of ``length`` elements back to back (``runs`` of them, one per
    sample after a flatten of ``(b t)``), each element ``inner`` entries long; ``lead``:
    the factors before ``dim`` in a group the op makes or reads, cut to one element first
    (a flatten's sample), so that a slice of ``dim`` is a slice of the group."""

    dim: str
    length: int
    runs: int = 1
    inner: int = 1
    lead: tuple[str, ...] = ()


def sequence_cuts(graph: Graph) -> tuple[dict[Op, SeqCut | None], dict[Op, str]]:
    """For each op, how it follows the sequence (axis 1 of the batch inputs) through the
    graph, past flattens of ``(b t)``; and the ops that read the sequence but cannot cut
    it, with why (``trail``'s)."""
    mark: dict[PTensor, tuple[int, int, int]] = {  # axis, sequence length, inner
        t: (1, t.shape[1], 1) for t in graph.batched_inputs() if len(t.shape) >= 2}
    cuts: dict[Op, SeqCut | None] = {}
    lost: dict[Op, str] = {}
    for op in graph.ops:
        cuts[op] = cut = _seq_cut(op, mark)
        if cut is None:
            if op.kind not in SHAPE_ONLY and any(t in mark and t.shape[mark[t][0]] > 1
                                                  for t in op.inputs):
                lost[op] = "no signature" if op.signature is None else \
                    "its signature cannot split that dim"
            continue
        sig = op.signature
        assert sig is not None  # (a cut is of a signature's dim)
        sizes = _sizes(op)
        for t, tdims in zip(op.outputs, sig.outputs):
            for a, axis in enumerate(tdims):
                names_ = [f.name for f in axis.factors]
                if cut.dim in names_:
                    after = axis.factors[names_.index(cut.dim) + 1:]
                    mark[t] = (a, cut.length, cut.inner * _product(after, sizes))
                    break
    return cuts, lost


def _sizes(op: Op) -> dict[str, int]:
    assert op.signature is not None
    return op.signature.bind(op.input_shapes, [t.shape for t in op.outputs])


def _product(factors: tuple, sizes: dict[str, int]) -> int:
    n = 1
    for f in factors:
        n *= f.size if f.size is not None else sizes[f.name]
    return n


def _before(sig: Signature, dim: str) -> list[Dim]:
    """The factors before ``dim`` in each group of the signature that holds it."""
    found: list[Dim] = []
    for tensor in (*sig.inputs, *sig.outputs):
        for axis in tensor:
            names_ = [f.name for f in axis.factors]
            if dim in names_:
                found += axis.factors[:names_.index(dim)]
    return found


def _seq_cut(op: Op, mark: dict[PTensor, tuple[int, int, int]]) -> SeqCut | None:
    """The cut of ``op`` along the sequence one of its marked inputs carries, if its
    signature can make it."""
    sig = op.signature
    if sig is None or op.kind in SHAPE_ONLY:
        return None
    sizes = _sizes(op)
    for t, tdims in zip(op.inputs, sig.inputs):
        if t not in mark or mark[t][0] >= len(tdims):
            continue
        a, length, inner = mark[t]
        factors = tdims[a].factors
        # the factor the sequence's elements run along: the only one, or in a group that
        # unflattens rows, the one ``length`` long with ``inner`` after it
        k = next((k for k, f in enumerate(factors) if f.size is None
                  and sizes[f.name] % length == 0
                  and _product(factors[k + 1:], sizes) == inner), None) \
            if len(factors) > 1 else 0
        if k is None or factors[k].size is not None:
            continue
        dim = factors[k].name
        if len(factors) > 1:
            inner = 1
        lead = tuple(dict.fromkeys(f.name for f in _before(sig, dim)
                                   if f.size is None and sizes[f.name] > 1))
        if dim not in sig.splittable({**sizes, **{name: 1 for name in lead}}):
            continue
        runs = sizes[dim] // (length * inner)
        if runs * length * inner != sizes[dim]:
            continue
        return SeqCut(dim, length, runs, inner, lead)
    return None


def feeders(graph: Graph) -> dict[Op, Op]:
    """Ops that make a weight from parameters alone for one op (a slice of gate and up side
    by side, a cast), each with that op: where a plan cuts the reader's weights, it cuts
    these alike (``cut_back``), so each device keeps only its part of the parameter."""
    readers: dict[PTensor, list[Op]] = {}
    for op in graph.ops:
        for t in op.inputs:
            readers.setdefault(t, []).append(op)
    outputs = {graph.loss, *graph.buffer_updates.values()}
    found: dict[Op, Op] = {}
    weights: set[PTensor] = set()  # made from parameters alone
    for op in graph.ops:
        if op.signature is None or not op.inputs or not all(
                t.kind is TensorKind.PARAM or t in weights for t in op.inputs):
            continue
        weights.update(op.outputs)
        read = {id(r): r for t in op.outputs for r in readers.get(t, ())}
        if len(read) == 1 and all(len(readers.get(t, ())) == 1 and t not in outputs
                                  for t in op.outputs):
            found[op] = next(iter(read.values()))
    return found


def cut_back(graph: Graph, dims: dict[Op, str]) -> dict[Op, str]:
    """``dims`` (the dim each op is cut along) with the ``feeders`` of those ops cut along
    the dims their weights' axes have there, where a signature dim can be; a feeder of a
    feeder too."""
    out = dict(dims)
    for op, reader in reversed(list(feeders(graph).items())):
        dim, sig = out.get(reader), op.signature
        if dim is None or op in out or reader.signature is None or sig is None:
            continue
        for t, tdims in zip(reader.inputs, reader.signature.inputs):
            if t not in op.outputs:
                continue
            a = next((a for a, axis in enumerate(tdims) if axis.factors[0].name == dim), None)
            axis = sig.outputs[op.outputs.index(t)][a] if a is not None else None
            if axis is not None and axis.factors[0].name in sig.splittable():
                out[op] = axis.factors[0].name
                break
    return out
