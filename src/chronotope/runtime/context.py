"""``rt``: what a generated rank program calls.

A forward piece's inputs enter a graph of their own (``enter``) unless they stay
linked to a local producer in the same backward region (see ``compile/autograd_regions.py``). A
region's backward (``backward``) is one ``torch.autograd.grad`` call from the
gradients arriving at its pieces' outputs to their entries: exactly those pieces'
share of their inputs' gradients, wherever the gradients are then sent. An entry
holds nothing of its inputs, so an input no op saves is freed once read, as when the
model runs eagerly.

Under a low precision (``runtime/precision.py``) the step runs under autocast, each
region's backward with autocast off, and communication casts as that module says; with
none (or plain fp32) every call here does exactly what it did before.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import time
import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from chronotope.errors import ChronotopeError
from chronotope.graph.registry import iter_tensors
from chronotope.graph.rng import Stream
from chronotope.plan.storage import replica_run
from chronotope.runtime.precision import Precision, no_autocast, wire_dtype
from chronotope.runtime.transport import Started


class _Entry(torch.autograd.Function):
    """Where a piece's graph starts: its inputs pass through (aliases, no copy), and the
    gradients that reach them wait on the node (``found``) for ``rt.backward``. ``anchor``,
    an empty leaf, is what the backward asks autograd for."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.found = None
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.found = grads
        return (None,) * (1 + len(grads))


class _Entered:
    """One piece's entry. A tensor the rank stores (a parameter region) enters as a leaf of
    its own, an alias autograd is asked about directly; any other passes through the
    entry's node, which keeps nothing of it, and ``anchor``, an empty leaf, is what is asked
    for it. What a missing gradient's zeros are shaped like is kept, not the tensors."""

    def __init__(self, tensors: Sequence[torch.Tensor], stored: Sequence[bool]) -> None:
        self.stored = stored
        self.passed = not all(stored)
        self.anchor = torch.empty(0, requires_grad=True) if self.passed else None
        self.node: Any = None
        self.leaves: list[torch.Tensor] = []
        self.like = [(t.shape, t.dtype, t.device) for t in tensors]

    def enter(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """What the piece reads: ``tensors`` as leaves or through the entry's node."""
        self.leaves = [t.detach().requires_grad_() for t, s in zip(tensors, self.stored) if s]
        if not self.passed:
            return tuple(self.leaves)
        outs = _Entry.apply(self.anchor, *(t for t, s in zip(tensors, self.stored) if not s))
        self.node = outs[0].grad_fn
        leaves, passed = iter(self.leaves), iter(outs)
        return tuple(next(leaves) if s else next(passed) for s in self.stored)

    def asked(self) -> list[torch.Tensor]:
        """What autograd is asked for: the anchor (if any tensor passed), then the leaves."""
        return ([self.anchor] if self.anchor is not None else []) + self.leaves

    def grads(self, found: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Each tensor's gradient, from what autograd found for ``asked()`` (zeros where
        none reached it)."""
        through = iter((self.node.found if self.node is not None else None)
                       or (None,) * len(self.like))
        leaves = iter(found[1:] if self.anchor is not None else found)
        got = [next(leaves) if s else next(through) for s in self.stored]
        return [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                for g, (shape, dtype, device) in zip(got, self.like)]


class StepContext:
    def __init__(
        self,
        rank: int,
        device: torch.device,
        stored: Mapping[tuple[str, tuple], torch.Tensor],
        owned: Mapping[tuple[str, tuple], nn.Parameter],
        state: MutableMapping[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
        transport: Any,
        targets: Mapping[str, Callable[..., Any]],
        ticks: list[float] | None = None,
        stream: Stream | None = None,
        precision: Precision | None = None,
        loss_scale: float = 1.0,
        replica: tuple[int, int, int] | None = None,
    ) -> None:
        self.rank = rank
        self.replica = replica  # a scaled plan's: (this replica, replicas, devices per replica)
        self.device = device
        self.stored = stored
        self.owned_params = owned
        self.state = state
        self.inputs = batch
        self.transport = transport
        self.targets = targets
        self.entries: dict[str, _Entered] = {}
        # ring attention's, by its gathers' outputs: while its pieces' backward needs it
        self._landed: weakref.WeakValueDictionary[tuple, Landed] = \
            weakref.WeakValueDictionary()
        # what the rank stores: a piece reads these as leaves of its own (``_Entered``)
        self._stored = {id(t) for t in stored.values()}
        # each piece's outputs as where their gradients enter its graph (None: no gradient)
        self.outputs: dict[str, tuple[GradientEdge | None, ...]] = {}
        # split backward: leaves whose gradients ``weight`` computes, and what it starts from
        self.later: dict[str, tuple[torch.Tensor, ...]] = {}
        self.kept: dict[str, tuple[list[GradientEdge], list[torch.Tensor | None]]] = {}
        self.micro_index: int | None = None  # the micro-batch a template's block runs
        self.totals: dict[str, torch.Tensor] = {}  # running sums over micro-batches
        self.summing: set[str] = set()  # those that are a sum of their own (added into)
        self.losses: list[float] = []
        self.ticks = ticks  # when each instruction ended, in code generated with ticks
        self.stream = stream or Stream()  # what this step's random ops draw (graph/rng.py)
        # None: fp32 as captured, nothing cast (bit for bit what it was without precision)
        self.precision = None if precision is None or precision.plain else precision
        self.loss_scale = loss_scale  # the loss's gradient (fp16's dynamic loss scale)

    # ---- leaves ----------------------------------------------------------------------------

    def param(self, name: str, region: tuple) -> torch.Tensor:
        """A parameter region this rank stores (what its pieces read)."""
        return self.stored[(name, region)]

    def owned(self, name: str, region: tuple) -> torch.Tensor:
        """A parameter region this rank updates (one whose runs the replicas update: the
        whole region, refreshed from the runs)."""
        found = self.owned_params.get((name, region))
        return self.stored[(name, region)] if found is None else found

    def _members(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """A collective's members in the order of its runs. A scaled plan's replicas run
        replica 0's code, where this rank's replicas are ``(d, d + unit, ...)``, itself
        first; the runs follow the replicas' global order, the same on every member."""
        if self.replica is None or max(ranks) < self.replica[2]:
            return ranks
        index, count, unit = self.replica
        return tuple(self.rank + (g - index) % count * unit for g in range(count))

    def input(self, name: str) -> torch.Tensor:
        return self.inputs[name]

    def buffer(self, name: str) -> torch.Tensor:
        return self.state[name]

    constant = buffer

    def target(self, op_name: str) -> Callable[..., Any]:
        return self.targets[op_name]

    # ---- autograd per piece --------------------------------------------------------------

    def micro(self, index: int | None) -> None:
        """Run micro-batch ``index``'s step of a template from here on (None: what runs
        once a step): its pieces' autograd state is kept apart from the others'."""
        self.micro_index = index

    def _key(self, name: str) -> str:
        return name if not self.micro_index else f"{name}@{self.micro_index}"

    def enter(self, name: str, tensors: Sequence[torch.Tensor], grad: Sequence[bool],
              later: Sequence[bool] = ()) -> tuple[torch.Tensor, ...]:
        """A piece's inputs as the start of its graph: those that want a gradient through
        its entry, the rest detached; those ``later`` (its parameters, when its backward is
        split) as leaves whose gradients ``weight`` computes, not ``backward``."""
        later = tuple(later) or (False,) * len(tensors)
        entering = [t for t, g, w in zip(tensors, grad, later) if g and not w]
        entry = _Entered(entering, [id(t) in self._stored for t in entering])
        name = self._key(name)
        self.entries[name] = entry
        entered = iter(entry.enter(entering))
        out = tuple(next(entered) if g and not w else
                    t.detach().requires_grad_() if g else t.detach()
                    for t, g, w in zip(tensors, grad, later))
        if any(later):
            self.later[name] = tuple(t for t, w in zip(out, later) if w)
        return out

    def leave(self, name: str, outputs: Sequence[torch.Tensor]) -> None:
        """Where the gradients of a piece's outputs will enter its graph: edges, not the
        outputs, so that an output nothing saves is freed once read, as in eager."""
        self.outputs[self._key(name)] = tuple(get_gradient_edge(o) if o.requires_grad else None
                                              for o in outputs)

    def backward(self, arriving: Mapping[str, Sequence[torch.Tensor | None]],
                 pieces: Sequence[str]) -> tuple[torch.Tensor, ...]:
        """The gradients of the leaves of ``pieces`` (in ``enter`` order), from the
        gradients ``arriving`` at their outputs (None: it flows inside the call). For a
        piece whose weight gradients come later, the gradients at its outputs and the
        graph are kept for ``weight``."""
        outputs, grads, kept = [], [], []
        for name in pieces:
            given = arriving.get(name, ())
            name = self._key(name)
            made = self.outputs.pop(name, ())
            for o, g in zip(made, given):
                if g is not None and o is not None:
                    outputs.append(o)
                    grads.append(g)
            if name in self.later:
                kept.append((name, [o for o in made if o is not None]))
        entries = [e for name in pieces if (e := self.entries.pop(self._key(name), None))]
        asked = [e.asked() for e in entries]
        flat = [t for ts in asked for t in ts]
        at = [o for _, outs in kept for o in outs]  # their total gradient, captured
        found: Sequence[torch.Tensor | None] = [None] * (len(flat) + len(at))
        if outputs and (flat or at):
            with self._backward_mode():
                found = torch.autograd.grad(outputs, flat + at, grads, allow_unused=True,
                                            retain_graph=bool(at))
        captured = iter(found[len(flat):])
        for name, outs in kept:
            self.kept[name] = (outs, [next(captured) for _ in outs])
        out: list[torch.Tensor] = []
        start = 0
        for e, ts in zip(entries, asked):
            out += e.grads(found[start:start + len(ts)])
            start += len(ts)
        return tuple(out)

    def weight(self, name: str) -> tuple[torch.Tensor, ...]:
        """The gradients of piece ``name``'s parameters, from what its ``backward`` kept:
        only that piece's part of the graph runs again, not what fed its inputs."""
        name = self._key(name)
        outs, grads = self.kept.pop(name, ([], []))
        leaves = self.later.pop(name)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        found: Sequence[torch.Tensor | None] = [None] * len(leaves)
        if pairs:
            with self._backward_mode():
                found = torch.autograd.grad([o for o, _ in pairs], leaves,
                                            [g for _, g in pairs], allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, found))

    def _backward_mode(self):
        """Backward as after an autocast forward: autocast off, each op in the dtype its
        forward ran in (autocast would cast the backward's matmuls again)."""
        if self.precision is None or not self.precision.low:
            return contextlib.nullcontext()
        return no_autocast(self.device.type)

    def seed(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The loss's gradient: ones, times fp16's loss scale."""
        if self.loss_scale == 1.0:
            return torch.ones(shape, dtype=dtype, device=self.device)
        return torch.full(shape, self.loss_scale, dtype=dtype, device=self.device)

    @staticmethod
    def tensors(result: Any) -> list[torch.Tensor]:
        return [t for t in iter_tensors(result) if isinstance(t, torch.Tensor)]

    # ---- communication -------------------------------------------------------------------

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as it travels: in the wire dtype under a precision, else as it is."""
        if self.precision is None:
            return t
        return t.to(wire_dtype(t.dtype))

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.precision is None else wire_dtype(dtype)

    def _summed(self, pieces: Sequence[torch.Tensor], grads: bool,
                ) -> tuple[torch.Tensor, torch.dtype]:
        """The local pieces added up in the dtype the reduction sums in, and the dtype the
        sum goes back to (what the pieces were). With no precision, or integer pieces:
        added up as they are. Under a precision, gradients (``grads``) sum in its reduce
        dtype, everything else in fp32 (fp64 stays fp64)."""
        if self.precision is None or not all(p.is_floating_point() for p in pieces):
            total = _sum(pieces)
            return total, total.dtype
        given = functools.reduce(torch.promote_types, [p.dtype for p in pieces])
        dtype = wire_dtype(given)
        if grads and given.itemsize <= 4:
            dtype = self.precision.reduce_dtype
        return _sum([p if p.dtype == dtype else p.to(dtype) for p in pieces]), given

    def send(self, t: torch.Tensor, to: int, tag: int) -> None:
        self.transport.send(self._wire(t), self.rank, to, tag)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int,
             async_op: bool = False) -> Any:
        if self.precision is None:
            return self.transport.recv(shape, dtype, src, self.rank, tag, self.device, async_op)
        got = self.transport.recv(shape, wire_dtype(dtype), src, self.rank, tag, self.device,
                                  True)
        return got.then(lambda t: _as(t, dtype)).returned(async_op)

    def landing(self, key: Source | None, value: Source | None) -> Landed:
        """The keys and values of an attention from ring gathers (a gather and which of its
        outputs; None: one that is not), waited for together: one for every piece that
        reads them, whose backward gives their gradients to the same ``Leaving``."""
        at = tuple(None if s is None else (id(s[0]), s[1]) for s in (key, value))
        found = self._landed.get(at)
        if found is None:
            found = self._landed[at] = Landed(key, value)
        return found

    def leaving(self, key: Source | None, value: Source | None, ranks: tuple[int, ...],
                takes: Sequence[tuple[int, int, tuple[slice, ...]]], async_op: bool = True
                ) -> Leaving:
        """The gradients of ring attention's keys and values leaving for their owners as
        the backward that follows makes them (``Leaving``)."""
        landed = self.landing(key, value)
        landed.leaving = Leaving(self, landed, takes)
        return landed.leaving

    def exchange(self, sends: list[dict[int, Any]], recvs: list[dict[int, tuple]],
                 ranks: tuple[int, ...], async_op: bool = False) -> Any:
        """Expert parallelism's all-to-all of routed rows, of one or more tensors (an entry
        of ``sends`` and ``recvs`` each) that move the same rows: each member in a tensor's
        ``sends`` gets its rows, all of them, or with ``(t, index, experts)`` those whose
        tokens ``index`` routes to one of ``experts``; from each member in its ``recvs``
        come rows of ``(shape, dtype)``, side by side as they come, or with ``(shape,
        dtype, index, experts)`` put back in the places of the tokens routed to
        ``experts`` (zeros elsewhere). A member's rows of every tensor travel side by side
        as bytes, in one call. Returns what came, tensor by tensor, in ``recvs``' order."""
        members = tuple(sorted(ranks))
        wires = [self._wire_dtype(next(iter(part.values()))[1]) for part in recvs]
        widths = [math.prod(next(iter(part.values()))[0][1:]) * w.itemsize
                  for part, w in zip(recvs, wires)]
        blocks = []
        for m in members:
            rows = []
            for part in sends:
                if m not in part:
                    break
                sent = part[m]
                if isinstance(sent, tuple):
                    t, index, experts = sent
                    sent = t[_routed(index, experts)]
                rows.append(_as_bytes(self._wire(sent.detach())))
            blocks.append(torch.cat(rows, 1) if rows else
                          torch.empty((0, sum(widths)), dtype=torch.uint8, device=self.device))
        counts = None  # a combine's: how many rows come back is this rank's own routing's
        if all(len(r) > 2 for r in recvs[0].values()):
            counts = [int(_routed(*recvs[0][m][2:]).numel()) if m in recvs[0] else 0
                      for m in members]
        started = self.transport.all_to_all_rows(blocks, members, self.rank, True, counts)

        edges = [0, *itertools.accumulate(widths)]  # each tensor's bytes in a row

        def placed(got: list[torch.Tensor]) -> list[torch.Tensor]:
            out = []
            for j, (part, wire) in enumerate(zip(recvs, wires)):
                for src, (shape, dtype, *routing) in part.items():
                    block = got[members.index(src)]
                    rows = block[:, edges[j]:edges[j + 1]].contiguous()
                    # one row or none: its slice is contiguous as it is, at any byte offset
                    if rows.storage_offset() % wire.itemsize or rows.stride(0) % wire.itemsize:
                        rows = rows.clone(memory_format=torch.contiguous_format)
                    rows = rows.view(wire).reshape(block.shape[0], *shape[1:]).to(dtype)
                    if routing:
                        rows = rows.new_zeros(shape).index_copy_(0, _routed(*routing), rows)
                    out.append(rows)
            return out

        return started.then(placed).returned(async_op)

    def all_reduce(self, tensors: Sequence[Sequence[torch.Tensor]], ranks: tuple[int, ...],
                   grads: bool = False, async_op: bool = False, plain: Sequence[int] = ()
                   ) -> Any:
        """For each entry, the sum of its local pieces and the other ``ranks``' pieces
        (``grads``: gradients, summed in the precision's reduce dtype, but for the entries
        ``plain``, such as a loss riding in a gradient bucket).

        All entries travel in one flat buffer: one collective call per instruction (per
        dtype, where a precision sums the gradients and the loss in two).
        """
        if self.precision is None:
            local = [_sum(pieces) for pieces in tensors]
            given = [t.dtype for t in local]
        else:
            summed = [self._summed(pieces, grads and i not in plain)
                       for i, pieces in enumerate(tensors)]
            local = [t for t, _ in summed]
            given = [dtype for _, dtype in summed]
        runs: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(local):
            runs.setdefault(t.dtype, []).append(i)
        if len(runs) > 1 and self.precision is None:  # one flat buffer: one dtype
            wide = functools.reduce(torch.promote_types, runs)
            local, runs = [_as(t, wide) for t in local], {wide: list(range(len(local)))}
        started = [(at, self._flat_all_reduce([local[i] for i in at], ranks))
                   for at in runs.values()]

        def parts() -> tuple[torch.Tensor, ...]:
            out: list[torch.Tensor | None] = [None] * len(local)
            for at, call in started:
                total = call.wait()
                for i, part in zip(at, total.split([local[i].numel() for i in at])):
                    out[i] = _as(part.view_as(local[i]), given[i])
            return tuple(out)

        return Started(parts).returned(async_op)

    def _flat_all_reduce(self, local: Sequence[torch.Tensor], ranks: tuple[int, ...]) -> Any:
        fresh = len(local) > 1  # a buffer made here: the transport may sum into it
        flat = torch.cat([t.reshape(-1) for t in local]) if fresh else local[0].reshape(-1)
        return self.transport.all_reduce(flat, ranks, self.rank, True, fresh)

    def all_gather(self, tensors: Sequence[torch.Tensor], ranks: tuple[int, ...],
                   dims: Sequence[int], async_op: bool = False, slots: tuple[int, ...] = (),
                   ring: bool = False) -> Any:
        """For each tensor, the members' pieces side by side along its dim, in ``ranks``
        order; with ``slots``, each member's piece is its runs side by side, placed where
        ``slots`` names it. All travel in one flat buffer: one collective call per
        instruction; with ``ring``, steps round a ring that land member by member
        (``Landing``)."""
        ranks = self._members(ranks)
        if ring:
            return Landing(self, tensors, ranks, dims, slots)
        members = tuple(sorted(ranks))
        started = self.transport.all_gather(self._flat(tensors), members, self.rank, True)

        def joined(stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = []
            for t, dim, part in zip(tensors, dims, stacked.split([t.numel() for t in tensors], 1)):
                # back to the dtype this rank's piece had
                pieces = _as(part.reshape(len(members), *t.shape), t.dtype)
                if slots:  # each member's runs, where its slots are
                    runs = {m: pieces[members.index(m)].chunk(slots.count(m), dim)
                            for m in members}
                    out.append(torch.cat([runs[m][slots[:i].count(m)]
                                          for i, m in enumerate(slots)], dim))
                elif dim == 0 and tuple(ranks) == members:  # side by side (one: no copy)
                    out.append(pieces.reshape(len(ranks) * t.shape[0], *t.shape[1:]))
                else:
                    out.append(torch.cat([pieces[members.index(r)] for r in ranks], dim))
            return tuple(out)

        return started.then(joined).returned(async_op)

    def _flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A gather's pieces as they travel: side by side in one flat buffer of their
        widest wire dtype."""
        wired = [self._wire(t.detach()) for t in tensors]
        wide = functools.reduce(torch.promote_types, [t.dtype for t in wired])
        return torch.cat([_as(t, wide).reshape(-1) for t in wired]) if len(wired) > 1 \
            else wired[0].contiguous().view(-1)

    def reduce_scatter(self, tensors: Sequence[Sequence[torch.Tensor]], ranks: tuple[int, ...],
                       dims: Sequence[int], grads: bool = False, async_op: bool = False) -> Any:
        """For each entry, run ``ranks.index(self.rank)`` along its dim of the sum over the
        members (``grads``: gradients, summed in the precision's reduce dtype). All entries
        travel in one flat buffer: one collective call per instruction."""
        ranks = self._members(ranks)
        summed = [self._summed(pieces, grads) for pieces in tensors]
        wide = functools.reduce(torch.promote_types, [t.dtype for t, _ in summed])
        members = tuple(sorted(ranks))
        runs = [_as(t, wide).chunk(len(ranks), dim) for (t, _), dim in zip(summed, dims)]
        if len(runs) == 1 and dims[0] == 0 and tuple(ranks) == members:
            rows = summed[0][0].reshape(-1)  # already member by member (the transport copies)
        else:  # member i (in rank order) gets run i: its runs of every entry side by side
            rows = torch.cat([r[ranks.index(m)].reshape(-1) for m in members for r in runs])
        started = self.transport.reduce_scatter(rows, members, self.rank, 0, True)

        def parts(mine: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(_as(part.view(r[0].shape), given) for part, r, (_, given)
                         in zip(mine.split([r[0].numel() for r in runs]), runs, summed))

        return started.then(parts).returned(async_op)

    def all_to_all(self, t: torch.Tensor, ranks: tuple[int, ...], dim: int,
                   readers: tuple[int, ...], split: int, async_op: bool = False) -> Any:
        """Member ``readers[k]`` gets run ``k`` along ``split`` of the region the members'
        pieces make side by side along ``dim`` (in ``ranks`` order); this is this rank's."""
        members = tuple(sorted(ranks))
        given = t.dtype
        runs = self._wire(t.detach()).chunk(len(readers), split)
        started = self.transport.all_to_all(
            [runs[readers.index(m)].contiguous() for m in members], members, self.rank, True)
        return started.then(lambda blocks: torch.cat(
            [blocks[members.index(r)].to(given) for r in ranks], dim)).returned(async_op)

    def broadcast(self, t: torch.Tensor | None, root: int, ranks: tuple[int, ...],
                  shape: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                  async_op: bool = False) -> Any:
        """``root``'s tensor on every member (the root passes it, the others its shape)."""
        if t is None:
            t = torch.empty(shape, dtype=wire_dtype(dtype) if self.precision else dtype,
                            device=self.device)
            started = self.transport.broadcast(t, root, ranks, self.rank, True)
            return started.then(lambda got: _as(got, dtype)).returned(async_op)
        return self.transport.broadcast(self._wire(t.detach()).contiguous(), root, ranks,
                                        self.rank, async_op)

    def gather_params(self, ranks: tuple[int, ...], params: Sequence[tuple[str, tuple, int]],
                      ) -> None:
        """Refresh stored parameters from their owners: member ``ranks[k]`` updated run ``k``
        along ``dim`` of each; all runs travel in one flat all-gather."""
        ranks = self._members(ranks)
        runs = [(self.stored[(name, index)].chunk(len(ranks), dim)) for name, index, dim in params]
        mine = ranks.index(self.rank)
        local = torch.cat([r[mine].reshape(-1) for r in runs])
        members = tuple(sorted(ranks))
        for member, flat in zip(members, self.transport.all_gather(local, members, self.rank)):
            if member == self.rank:
                continue
            offset = 0
            for r in runs:
                dst = r[ranks.index(member)]
                dst.copy_(flat[offset:offset + dst.numel()].view_as(dst))
                offset += dst.numel()

    @staticmethod
    def reshard(gathered: Sequence[torch.Tensor]) -> None:
        """Free the storage of gathered parameters; autograd's saved tensors keep pointing
        into it, and ``refill`` gives it back before their backward."""
        for t in gathered:
            t.untyped_storage().resize_(0)

    @staticmethod
    def refill(gathered: Sequence[torch.Tensor], fresh: Sequence[torch.Tensor]) -> None:
        """Give resharded parameters their storage back, copied from the same gather run
        again (laid out alike, output by output). Storage-level copies leave the tensors'
        version counters alone, as autograd's saved tensors need."""
        for old, new in zip(gathered, fresh):
            storage = old.untyped_storage()
            if storage.nbytes() == 0:  # outputs that share one buffer: the first refills it
                storage.resize_(new.untyped_storage().nbytes())
                storage.copy_(new.untyped_storage())

    def assemble(self, shape: tuple[int, ...], dtype: torch.dtype,
                 parts: Sequence[tuple[torch.Tensor, tuple[slice, ...], float]]) -> torch.Tensor:
        """Regions side by side, partial values summed."""
        if len(parts) > 1 and all(t.shape == shape and t.dtype == dtype and scale == 1
                                  for t, _, scale in parts):  # whole values: one sum
            out = parts[0][0].detach() + parts[1][0].detach()
            for t, _, _ in parts[2:]:
                out += t.detach()
            return out
        out = torch.zeros(shape, dtype=dtype, device=self.device)
        for t, where, scale in parts:
            t = t.detach()
            out[where] += t * scale if scale != 1 else t
        return out

    def add(self, dtype: torch.dtype, *parts: torch.Tensor) -> torch.Tensor:
        """Whole values of one tensor added up (in ``dtype``, as ``assemble`` sums them)."""
        whole = tuple(slice(0, n) for n in parts[0].shape)
        return self.assemble(tuple(parts[0].shape), dtype, [(t, whole, 1.0) for t in parts])

    @staticmethod
    def add_into(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """A running sum made here and read nowhere else, with one more part added in place."""
        return total.add_(part.detach())

    def accumulate(self, total: str, part: torch.Tensor, dtype: torch.dtype) -> None:
        """Add ``part`` to the step's running total ``total`` (a sum over micro-batches):
        the first part is the total as it is, the second makes a sum of its own (in
        ``dtype``, as ``assemble`` sums), and the later ones are added into it in place."""
        found = self.totals.get(total)
        if found is None:
            self.totals[total] = part.detach()
        elif total in self.summing:
            found.add_(part.detach())
        else:
            whole = tuple(slice(0, n) for n in part.shape)
            self.totals[total] = self.assemble(tuple(part.shape), dtype,
                                               [(found, whole, 1.0), (part, whole, 1.0)])
            self.summing.add(total)

    def total(self, name: str) -> torch.Tensor:
        """Running total ``name``, done (the runtime lets go of it)."""
        self.summing.discard(name)
        return self.totals.pop(name)

    def tick(self) -> None:
        """The instruction before this call has ended (its device work included)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ticks.append(time.perf_counter())

    # ---- results -------------------------------------------------------------------------

    def grad(self, param: str, region: tuple, g: torch.Tensor, run: int | None = None) -> None:
        if run is not None:  # this replica's run of the region (``Plan.scale``)
            index, count, _ = self.replica
            region = replica_run(region, run, index, count)
        p = self.owned_params[(param, region)]
        g = g.detach()
        if g.dtype != p.dtype:  # a gradient that travelled or summed in another dtype
            g = g.to(p.dtype)
        p.grad = g if p.grad is None else p.grad + g

    def loss(self, value: torch.Tensor) -> None:
        self.losses.append(float(value.detach()))

    def set_buffer(self, name: str, value: torch.Tensor) -> None:
        """Buffer ``name`` after this step (running statistics): what the next step reads."""
        self.state[name] = value.detach().clone()


class Landing:
    """An all-gather as steps round a ring: at step ``s`` each member's piece (its outputs'
    runs side by side, flat) goes to the member ``s`` after it, and what comes lands in
    the whole outputs when waited for, so a reader takes the runs in place while the rest
    travel (context parallelism's ring, ``compile/ring.py``). The members come this
    rank's first, then the one before it, and so on."""

    def __init__(self, rt: StepContext, tensors: Sequence[torch.Tensor], ranks: tuple[int, ...],
                 dims: Sequence[int], slots: tuple[int, ...]) -> None:
        me, n = ranks.index(rt.rank), len(ranks)
        self.rank, self.ranks = rt.rank, ranks
        flat = rt._flat(tensors)
        self.tensors, self.dims = [t.detach() for t in tensors], list(dims)
        self.slots = slots or ranks  # the member of each run along a tensor's dim
        # one step round the ring per member: each member's piece to the one ``s`` after
        # it, a collective of the group (in the same order on every member, as NCCL needs)
        self.coming = {}
        for s in range(1, n):
            to, frm = ranks[(me + s) % n], ranks[(me - s) % n]
            self.coming[frm] = rt.transport.all_to_all_rows(
                [flat if m == to else flat[:0] for m in ranks], ranks, rt.rank, True,
                [flat.numel() if m == frm else 0 for m in ranks]).then(
                    operator.itemgetter(ranks.index(frm)))
        own = self.slots.count(rt.rank)
        self.outputs = [t.new_empty(_whole(t.shape, d, own, len(self.slots)))
                        for t, d in zip(self.tensors, dims)]
        self._place(rt.rank, self.tensors)
        order = {ranks[(me - s) % n]: s for s in range(n)}  # this rank's, then round
        size = self.tensors[0].shape[dims[0]] // own
        self._runs = sorted(((j * size, (j + 1) * size) for j in range(len(self.slots))),
                            key=lambda r: order[self.slots[r[0] // size]])
        self._size = size

    def runs(self) -> list[tuple[int, int]]:
        """The runs of the first output along its dim, in the order they land."""
        return self._runs

    def run(self, index: int) -> tuple[int, int]:
        return self._runs[index]

    def member(self, index: int) -> int:
        """The member whose piece run ``index`` (of ``runs()``) is."""
        return self.slots[self._runs[index][0] // self._size]

    def runs_of(self, member: int) -> list[int]:
        """The runs of ``member``'s piece (indices of ``runs()``), in their order along the
        dim (the same on every member)."""
        return sorted((i for i in range(len(self._runs)) if self.member(i) == member),
                      key=lambda i: self._runs[i][0])

    def wait(self, run: int | None = None) -> tuple[torch.Tensor, ...]:
        """Until run ``run`` (of ``runs()``) is in place, or with None every run; the
        whole outputs."""
        if run is None:
            for m in list(self.coming):
                self._land(m)
        else:
            member = self.slots[self._runs[run][0] // self._size]
            if member in self.coming:
                self._land(member)
        return tuple(self.outputs)

    def landing(self) -> tuple[torch.Tensor, ...]:
        """The whole outputs now, the members' runs landing in them as they are waited for."""
        return tuple(self.outputs)

    def _land(self, member: int) -> None:
        flat = self.coming.pop(member).wait()
        parts = flat.split([t.numel() for t in self.tensors])
        self._place(member, [_as(p.view_as(t), t.dtype) for p, t in zip(parts, self.tensors)])

    def _place(self, member: int, pieces: Sequence[torch.Tensor]) -> None:
        at = [j for j, m in enumerate(self.slots) if m == member]
        with torch.no_grad():
            for out, piece, dim in zip(self.outputs, pieces, self.dims):
                width = piece.shape[dim] // len(at)
                for k, j in enumerate(at):
                    out.narrow(dim, j * width, width).copy_(piece.narrow(dim, k * width, width))


Source = tuple["Landing", int]  # a ring gather and which of its outputs


class Landed:
    """An attention's keys and values from ``Landing`` gathers (None: one that is not),
    waited for together (``graph.attention.Arriving``). The pieces that read them say which
    runs (``read``); in the backward, with a ``leaving``, each gives its gradients of the
    runs other members own to it (``leave``) and keeps this rank's own."""

    def __init__(self, key: Source | None, value: Source | None) -> None:
        self.sources = (key, value)
        first = key or value
        assert first is not None
        self.first = first[0]
        self.readers: dict[Any, tuple[int, ...]] = {}  # per reading piece, the runs it read
        self.leaving: Leaving | None = None

    def runs(self) -> list[tuple[int, int]]:
        return self.first.runs()

    def wait(self, run: int | None = None) -> None:
        for source in self.sources:
            if source is not None:
                source[0].wait(run)

    def read(self, piece: Any, runs: Sequence[int]) -> None:
        self.readers[piece] = tuple(runs)

    def own(self, run: int) -> bool:
        """Whether run ``run`` (of ``runs()``) is this rank's."""
        return self.first.member(run) == self.first.rank

    def leave(self, piece: Any, run: int, grads: Sequence[torch.Tensor]) -> bool:
        """Give the leaving the gradients (the keys', the values') piece ``piece`` has of
        run ``run``: another member's, or this rank's where the leaving keeps them; False
        when none leaves (they go back whole)."""
        if self.leaving is None or (self.own(run) and not self.leaving.keeps):
            return False
        self.leaving.leave(piece, run, grads)
        return True


class Leaving:
    """The gradients of ring attention's keys and values, each member's runs sent to it
    as soon as every piece here that read them gave its part: step ``s`` of the ring sends
    the member ``s`` before this rank its runs and takes this rank's from the member ``s``
    after it, one collective of the group each, called in step order on every member (as
    NCCL needs), during the backward, so the bytes move while it goes on. ``wait`` gives
    the boxes the compiler named (``takes``: the keys' or values', from which member,
    where in the whole gathered tensor) of what came; a box from this rank is of the sum
    its pieces gave of its own runs, which it then keeps (``keeps``): no piece makes a
    gradient of the whole keys and values."""

    def __init__(self, rt: StepContext, landed: Landed,
                 takes: Sequence[tuple[int, int, tuple[slice, ...]]]) -> None:
        self.rt, self.landed, self.takes = rt, landed, list(takes)
        self.keeps = any(src == rt.rank for _, src, _ in self.takes)
        self.roles = [role for role, s in enumerate(landed.sources) if s is not None]
        first = landed.first
        self.ranks, self.me = first.ranks, first.ranks.index(rt.rank)
        self.parts: dict[int, dict[int, torch.Tensor]] = {}  # per run, by role: the sum here
        self.given: dict[int, set[Any]] = {}  # per run, the pieces that gave theirs
        self.came: dict[int, Started] = {}  # per member, its step's collective
        self.step = 1  # the next step to start
        self._start_ready()

    def leave(self, piece: Any, run: int, grads: Sequence[torch.Tensor]) -> None:
        parts = self.parts.setdefault(run, {})
        with torch.no_grad():
            for role in self.roles:
                g = grads[role].detach()
                parts[role] = g.clone() if role not in parts else parts[role].add_(g)
        self.given.setdefault(run, set()).add(piece)
        self._start_ready()

    def wait(self) -> tuple[torch.Tensor, ...]:
        self._start_ready()
        if self.step < len(self.ranks):
            missing = [r for r in range(len(self.landed.runs())) if not self._complete(r)]
            raise ChronotopeError(f"rank {self.rt.rank}: ring attention's backward gave no "
                                  f"gradient of key runs {missing} that its forward read: "
                                  f"this is a bug in chronotope")
        came = {m: started.wait() for m, started in self.came.items()}
        self.came, self.landed.leaving = {}, None  # (what came is held by its boxes alone)
        first = self.landed.first
        mine = first.runs_of(self.rt.rank)
        out = []
        for role, src, box in self.takes:
            dim = self._dim(role)
            lo, hi = box[dim].start, box[dim].stop
            run = next(r for r in mine if first.run(r)[0] <= lo and hi <= first.run(r)[1])
            block = self._block(run, role) if src == self.rt.rank else \
                came[src][mine.index(run)][self.roles.index(role)]
            shift = first.run(run)[0]
            out.append(block[tuple(slice(lo - shift, hi - shift) if d == dim else s
                                   for d, s in enumerate(box))])
        return tuple(out)

    def _complete(self, run: int) -> bool:
        readers = {p for p, runs in self.landed.readers.items() if run in runs}
        return readers <= self.given.get(run, set())

    def _start_ready(self) -> None:
        """Start every step whose runs are complete, in step order."""
        first = self.landed.first
        n = len(self.ranks)
        mine = first.runs_of(self.rt.rank)
        while self.step < n:
            to = self.ranks[(self.me - self.step) % n]
            runs = first.runs_of(to)
            if not all(self._complete(r) for r in runs):
                return
            frm = self.ranks[(self.me + self.step) % n]
            flat = self.rt._flat([self._block(r, role) for r in runs for role in self.roles])
            size = sum(math.prod(self._shape(r, role)) for r in mine for role in self.roles)
            at = self.ranks.index(frm)
            self.came[frm] = self.rt.transport.all_to_all_rows(
                [flat if m == to else flat[:0] for m in self.ranks], self.ranks, self.rt.rank,
                True, [size if m == frm else 0 for m in self.ranks]).then(
                    lambda got, at=at: self._split(got[at], mine))
            for r in runs:  # sent: no longer kept here
                self.parts.pop(r, None)
            self.step += 1

    def _output(self, role: int) -> torch.Tensor:
        source = self.landed.sources[role]
        assert source is not None
        return source[0].outputs[source[1]]

    def _dim(self, role: int) -> int:
        source = self.landed.sources[role]
        assert source is not None
        return source[0].dims[source[1]]

    def _shape(self, run: int, role: int) -> tuple[int, ...]:
        lo, hi = self.landed.first.run(run)
        dim = self._dim(role)
        return tuple(hi - lo if d == dim else n for d, n in enumerate(self._output(role).shape))

    def _block(self, run: int, role: int) -> torch.Tensor:
        """This rank's sum of run ``run`` of a gradient (zeros: no piece here read it)."""
        part = self.parts.get(run, {}).get(role)
        if part is not None:
            return part
        out = self._output(role)
        return torch.zeros(self._shape(run, role), dtype=out.dtype, device=out.device)

    def _split(self, flat: torch.Tensor, mine: list[int]) -> list[list[torch.Tensor]]:
        """What came from one member: per run of this rank's, each role's block."""
        out, at = [], 0
        for r in mine:
            blocks = []
            for role in self.roles:
                shape = self._shape(r, role)
                n = math.prod(shape)
                blocks.append(_as(flat[at:at + n].view(shape), self._output(role).dtype))
                at += n
            out.append(blocks)
        return out


def _whole(shape: Sequence[int], dim: int, own: int, runs: int) -> tuple[int, ...]:
    """A gathered output's shape: ``runs`` runs along ``dim``, of which a piece of ``shape``
    holds ``own``."""
    return tuple(n // own * runs if d == dim else n for d, n in enumerate(shape))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _sum(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The pieces added up; one piece as it is (the transport copies what it changes)."""
    total = pieces[0].detach()
    for p in pieces[1:]:
        total = total + p.detach()
    return total


def _routed(index: torch.Tensor, experts: range) -> torch.Tensor:
    """The tokens (rows of ``index``, tokens x k) routed to at least one of ``experts``."""
    return ((index >= experts.start) & (index < experts.stop)).any(-1).nonzero().squeeze(-1)


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """Rows as the bytes they hold, a row of bytes each (none: a router that sent no token
    to a rank's experts)."""
    return rows.contiguous().reshape(rows.shape[0], math.prod(rows.shape[1:])).view(torch.uint8)
