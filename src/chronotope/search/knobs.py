"""The mesh policy's knobs searched: what experts choose at scale, priced point by point.

Training GPT-3 175B on 1,024 GPUs, experts choose a handful of numbers: data, tensor and
pipeline degrees, the micro-batches, interleaved stages or zero bubble, recompute or swap,
sequence parallelism, the optimizer state sharded over the data-parallel replicas, the
dtype. Each point of that space is ``policies.mesh`` (Megatron's cuts, stages of about
equal compute, 1F1B, ZB-H1 or interleaved order, folded: planned for one micro-batch), or
up to 64 devices ZeRO-3 over them all, tensor parallel inside each replica or not
(``policies.zero``), priced here without building it:

- each op's time on one micro-batch: its compute at the dtype's FLOP rate under the cut
  tensor parallelism makes of it, and the layout changes of what it reads
  (``stages.op_seconds`` on the ILP's strategies over the ``tp`` devices); a
  recomputed op runs its forward once more;
- a rank's time per micro-batch is its stages' and the messages to the next stage; the
  step is ``micro * T + (sum(T) - T) / chunks`` for the slowest rank's ``T`` (1F1B's fill
  and drain, shortened by interleaving, a third of it under zero bubble), then the
  gradients' all-reduce over the data-parallel replicas (a reduce-scatter and, after the
  step, an all-gather where they share the optimizer state out) and the optimizer's
  update; a swapped op's saved tensors cross the host link out and back;
- expert parallelism over ``ep`` of the data-parallel replicas keeps ``1 / ep`` of each
  Mixture-of-Experts layer's experts on a device, and adds per experts op its group's
  tokens gathered and their outputs reduce-scattered, forward and backward;
- context parallelism over ``cp`` devices divides what every op along the sequence
  computes and keeps by ``cp`` (a zigzag keeps causal attention balanced), and adds per
  attention its keys and values gathered (forward, and again for the backward) and
  their gradients reduce-scattered over the group, or for Ulysses its query, keys,
  values and output exchanged all-to-all both ways; the weights' gradients are summed
  over ``dp * cp`` devices;
- a device holds its stages' weights, gradients and optimizer state (fp32, their
  tensor-parallel slices) and, per micro-batch its schedule keeps in flight, what its
  ops keep for the backward as the plan's estimate counts it: outputs as autocast makes
  them (16 bits after a linear), a 16-bit copy of each weight a linear casts, one copy
  of an input read in another layout than made (a gathered sequence slice), a
  recomputed or swapped op none but that copy (and what crosses a recompute boundary);
  and the largest backward's gradients, a recomputed layer's tensors made again or a
  swapped op's brought back.

The cheapest points that fit are built (data parallel as replicas of one group,
``plan.scale``, where the graph of one replica's rows can be had) and checked by the
plan's own memory estimate; the search simulates them and keeps the fastest.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from chronotope.compile.simulate import OPTIMIZER_PASSES
from chronotope.cost.network import Cluster
from chronotope.errors import PlanError
from chronotope.graph.autocast import casting, itemsizes, saved_tensors, saves, storage_of
from chronotope.graph.axes import batch_dims, feeders, loss_tails, sequence_cuts, sequence_dims
from chronotope.graph.experts import reach
from chronotope.graph.ir import Graph, Op, PTensor
from chronotope.plan.algo import Replicate, Split
from chronotope.plan.check import optimizer_states
from chronotope.plan.plan import Plan, differentiable
from chronotope.plan.steps import live_counts
from chronotope.plan.storage import unit
from chronotope.policies.context import context
from chronotope.policies.mesh import (
    _crossing,
    _spans,
    checkpointed,
    data_only,
    mesh,
    recycled_stages,
    stages,
    tensor_parallel_dims,
)
from chronotope.policies.pipeline import SCHEDULES
from chronotope.policies.zero import zero
from chronotope.search.ilp import _op_sync, _weight_bytes, first_reads, later_reads
from chronotope.search.space import Mesh, Pricer, Strategy, sharded, strategies
from chronotope.search.stages import crossing_bytes, op_seconds

# the columns of ``Model.terms`` a device's share of the sequence divides (its compute,
# what it keeps, what its backward holds, the copies it reads and keeps), not the weights'
_ALONG = np.array([1, 1, 0, 0, 0, 0, 1, 1, 1, 0])
# and those a device's share of the experts divides: their weights' copies, state, sync,
# gradients and whole-read gradients
_WEIGHTS = np.array([0, 0, 1, 1, 1, 1, 0, 0, 0, 1])
# what the backward's saved tensors become: (recompute, swap): kept, made again in part
# or whole, or swapped to host memory (where the cluster says how fast its link is)
KEPT = ((None, False), ("selective", False), ("full", False), (None, True))
ZERO3_UP_TO = 64  # devices ZeRO-3 is tried on: its plan is written for every one of them
MIN_CHUNK = 1024  # the fewest tokens of a sequence chunk context parallelism is tried with
# the pipeline schedules tried: (stages per rank, zero bubble): 1F1B, ZB-H1, interleaved
SCHEDULE_KNOBS = ((1, False), (1, True), (2, False), (4, False))


@dataclass(frozen=True)
class Knobs:
    """One point: ``dp`` replicas of ``pp`` stages of ``tp`` devices; ``micro`` micro-batches
    per replica; ``chunks`` stages per rank (interleaved 1F1B beyond one)."""

    dp: int
    tp: int
    pp: int
    micro: int
    chunks: int = 1
    recompute: str | None = None
    sequence: bool = False
    shard: bool = False  # the optimizer state shared out over the dp replicas (ZeRO-1)
    zero_bubble: bool = False  # one stage per rank: backwards split, ZB-H1's order
    swap: bool = False  # what recompute full would make again waits in host memory
    zero3: bool = False  # one stage, every weight (tp shard) stored 1 / dp (ZeRO-3, FSDP)
    cp: int = 1  # context parallel: every op along the sequence over cp groups of tp
    attention: str = "allgather"  # how its attention meets (``policies/context.py``)
    ep: int = 1  # expert parallel: MoE layers' experts shared out over ep of the dp replicas
    coshard: int = 1  # each attention and MLP in this many parts a device runs in turn
    recycle: bool = False  # 3F1B: a stage of each recycling pass per rank (``chunks`` passes)

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def schedule(self) -> str:
        if self.recycle:
            return "3f1b"
        if self.chunks > 1:
            return "interleaved"
        return "zb1" if self.zero_bubble else "1f1b"

    @property
    def label(self) -> str:
        way = f" ({self.attention})" if self.attention != "allgather" else ""
        cp = f" x cp {self.cp}{way}" if self.cp > 1 else ""
        cp += f", experts over ep {self.ep}" if self.ep > 1 else ""
        text = f"dp {self.dp} x tp {self.tp} x pp {self.pp}{cp}, {self.micro} micro-batches"
        if self.recycle:
            text += f", 3F1B over {self.chunks} passes"
        elif self.chunks > 1:
            text += f", {self.chunks} stages per rank"
        if self.zero_bubble:
            text += ", zero bubble"
        if self.coshard > 1:
            text += f", co-shard {self.coshard}"
        if self.recompute:
            text += f", recompute {self.recompute}"
        if self.swap:
            text += ", swap"
        if self.zero3:
            text += ", ZeRO-3 (weights sharded, gathered per layer)"
        text += ", sequence parallel" if self.sequence else ""
        return text + (", optimizer state sharded over dp" if self.shard else "")

    def plan(self, graph: Graph, dtype: str = "fp32",
             replica: Callable[[int], Graph] | None = None) -> Plan:
        """The point as a plan: ``policies.mesh`` folded over its micro-batches; with
        ``replica`` (the graph of ``1 / r`` of the batch), one replica scaled ``dp`` times
        (which the optimizer state's sharding needs)."""
        if self.zero3:  # its weights shared out over every device: one plan of them all
            plan = zero(graph, self.devices, 3, tp=self.tp)
            plan.dtype = dtype
            return plan
        groups = self.dp // self.ep  # of ep replicas sharing their experts: the scale unit
        unit = replica(groups) if replica is not None and groups > 1 else graph
        dp = self.dp if unit is graph else self.ep
        if self.shard and dp > 1:
            raise PlanError("the optimizer state is shared out over data-parallel replicas "
                            "(plan.scale): give the graph of one replica's rows (replica=)")
        plan = mesh(unit, dp=dp, tp=self.tp, pp=self.pp, micro=self.micro,
                    schedule=self.schedule, chunks=1 if self.recycle else self.chunks,
                    recompute=self.recompute, swap="full" if self.swap else None,
                    sequence=self.sequence,
                    fold=self.micro > 1 and self.coshard == 1 and not self.recycle,
                    cp=self.cp, cp_attention=self.attention, ep=self.ep, coshard=self.coshard)
        plan.dtype = dtype
        return plan.scale(self.dp // dp, self.shard) if dp != self.dp else plan


@dataclass
class Priced:
    knobs: Knobs
    seconds: float  # the model's step time
    memory: float  # bytes on the fullest device
    states: float  # of ``memory``: weights, gradients and optimizer state
    rank: int  # the fullest device's stage rank


class Model:
    """What pricing any point of one graph on one cluster needs, made once."""

    def __init__(self, graph: Graph, cluster: Cluster, dtype: str = "fp32",
                 optimizer: str | float = "adam") -> None:
        self.graph, self.cluster, self.dtype = graph, cluster, dtype
        self.states = 2 + optimizer_states(optimizer)  # the weight, its gradient, its state
        self.ops = graph.ops
        self.whole = Plan(graph, 1)
        self.batch = graph.batch_size or 1
        self.batch_dim = batch_dims(graph)
        self.params = set(graph.params.values())
        self.needs_grad = differentiable(graph)
        self.kept = itemsizes(graph, dtype)
        self.casting = casting(graph, dtype)
        self.saves = saves(graph, dtype)
        self.views = storage_of(graph, dtype)
        self.saved = saved_tensors(graph, dtype, {
            op for op in graph.ops if any(t in self.needs_grad for t in op.inputs)})
        self.keep = data_only(graph) | set(loss_tails(graph, self.batch_dim,
                                                      self.whole.registry))
        self.blocks = _blocks(graph)
        cuts, _ = sequence_cuts(graph)
        self.along = np.array([cuts[op] is not None for op in graph.ops])  # the sequence's
        self.attention = [i for i, op in enumerate(graph.ops)
                          if op.kind == "attention" and cuts[op] is not None]
        self.length = max((c.length for c in cuts.values() if c is not None), default=0)
        self.experts = [i for i, op in enumerate(graph.ops) if op.kind == "experts"]
        # of each op, whether the weights it reads first are experts' (shared out by ep):
        # an experts op's, or one's that makes its weights (a half of gate and up)
        made_for = feeders(graph)
        self.expert_weights = np.array([_served(op, made_for).kind == "experts"
                                        for op in graph.ops])
        names = [unit(op) for op in graph.ops]  # what a backward call recomputes at once
        self.units = np.unique(np.array([str(n) for n in names]), return_inverse=True)[1]
        self.first = first_reads(self.ops)
        index = {op: i for i, op in enumerate(self.ops)}
        self.later = [(index[op], i, index[first]) for op, i, first, _ in later_reads(self.ops)]
        self._shared: dict[tuple[int, bool], list[tuple[int, int, float]]] = {}
        self.readers: dict[PTensor, list[tuple[int, int]]] = {}  # (reader, input)
        for r, op in enumerate(self.ops):
            for j, t in enumerate(op.inputs):
                self.readers.setdefault(t, []).append((r, j))
        self._kept_across: dict[tuple, np.ndarray] = {}
        self.storage: dict[PTensor, list[PTensor]] = {}  # a tensor and the views of it
        for view, root in self.views.items():
            self.storage.setdefault(root, [root]).append(view)
        self._choices: dict[tuple[int, bool], dict[Op, Strategy]] = {}
        self._terms: dict[tuple, np.ndarray] = {}
        self._times: dict[tuple, np.ndarray] = {}
        self._stages: dict[tuple[int, bool], np.ndarray] = {}
        self._recycled: dict[int, np.ndarray] = {}
        self.passes = _recycling(graph, self.needs_grad)
        self._recomputed: dict[str | None, np.ndarray] = {}
        self._cosharded: dict[tuple[int, int], np.ndarray] = {}
        self._sends: dict[tuple, float] = {}
        self._crossed: dict[int, float] = {}
        self._networks_of: dict[tuple[int, int, int, int], np.ndarray] = {}

    # ---- per op ----------------------------------------------------------------------

    def choice(self, tp: int, sequence: bool) -> dict[Op, Strategy]:
        """Each op's strategy over ``tp`` devices as ``policies.mesh`` cuts it."""
        key = (tp, sequence)
        if key not in self._choices:
            space = strategies(self.graph, Mesh((tp,)), self.cluster, whole=self.whole,
                               dtype=self.dtype)
            splits = tensor_parallel_dims(self.graph, tp, experts=not sequence) \
                if tp > 1 else {}
            seq = sequence_dims(self.graph) if sequence else {}
            out = {}
            for op in self.ops:
                split = splits.get(op)
                dim = split.dim if split is not None else seq.get(op)
                wanted = (Split(dim, tp),) if dim is not None and tp > 1 else (Replicate(tp),)
                found = [s for s in space.get(op, ()) if not s.zero]
                pick = next((s for s in found if s.algos == wanted), None) or next(
                    (s for s in found if s.algos == (Replicate(tp),)), None)
                if pick is not None:
                    out[op] = pick
            self._choices[key] = out
        return self._choices[key]

    def terms(self, tp: int, sequence: bool) -> np.ndarray:
        """Per op: [compute s (forward and backward, whole batch), kept bytes (whole
        batch: its outputs some backward saves, its statistics and 16-bit copies of
        activations), cast weight copies, weight state bytes, once-a-step sync s, weight
        gradient bytes, what its backward holds (whole batch), the copies it keeps of
        inputs read in another layout than made (whole batch: a column-parallel linear's
        gathered input under sequence parallelism) that it saves, those it reads at all
        (what it keeps to be run again), and of its weight gradient bytes those of weights
        every tensor-parallel rank reads whole]."""
        key = (tp, sequence)
        if key not in self._terms:
            choice, m = self.choice(tp, sequence), Mesh((tp,))
            pricer = Pricer(m, self.cluster)
            rows = []
            # a tensor in another layout: one copy, all readers' (counted by the first that
            # reads it, and apart by the first that saves it)
            read: set[tuple] = set()
            saved: set[tuple] = set()
            for op in self.ops:
                s = choice.get(op)
                if s is None:
                    rows.append((0.0,) * 10)
                    continue
                regathered = rerun = 0.0  # kept: it saves it; run again: it reads it
                saves_ = self.saves.get(op)
                for i, (t, lay) in enumerate(zip(op.inputs, s.inputs)):
                    if t.producer not in choice or t not in self.needs_grad or choice[
                            t.producer].outputs[t.producer.outputs.index(t)] == lay:
                        continue
                    nbytes = self._bytes(t) / sharded(lay, m)
                    if (t, lay) not in read:
                        read.add((t, lay))
                        rerun += nbytes
                    if (t, lay) not in saved and (saves_ is None or i in saves_.inputs):
                        saved.add((t, lay))
                        regathered += nbytes
                own = [sharded(lay, m) for lay in s.outputs] or [1]
                kept = sum(self._bytes(t) / sharded(lay, m)
                           for t, lay in zip(op.outputs, s.outputs)
                           if t in self.saved and t not in self.views)
                if saves_ is not None:
                    kept += saves_.other / max(own) + sum(
                        2 * math.prod(op.inputs[j].shape) / sharded(s.inputs[j], m)
                        for j in saves_.cast if op.inputs[j] not in self.params)
                held = sum(self._bytes(t) / sharded(lay, m)
                           for t, lay in zip((*op.inputs, *op.outputs), (*s.inputs, *s.outputs))
                           if t not in self.params and (t in self.needs_grad or t in op.outputs))
                if saves_ is not None:  # and what it makes while it runs (what it saved: kept)
                    held += saves_.backward_temp / max(own)
                params = [(i, t) for i, t in enumerate(op.inputs) if t in self.params]
                copies = sum(2 * math.prod(t.shape) / sharded(s.inputs[i], m)
                             for i, t in params) if op in self.casting else 0.0
                trained = [i for i in self.first[op] if op.inputs[i] in self.needs_grad]
                grads = sum(math.prod(op.inputs[i].shape) * 4 / sharded(s.inputs[i], m)
                            for i in trained)
                whole = sum(math.prod(op.inputs[i].shape) * 4 for i in trained
                            if sharded(s.inputs[i], m) == 1)
                rows.append((s.compute, kept, copies,
                             _weight_bytes(op, s, self.first[op], self.states, m),
                             _op_sync(op, s, self.first[op], pricer), grads, held,
                             regathered, rerun, whole))
            self._terms[key] = np.array(rows).reshape(len(self.ops), 10)
        return self._terms[key]

    def kept_across(self, k: Knobs) -> np.ndarray:
        """Per op, the bytes (whole batch) of its outputs kept from the forward to the
        backward because recomputation crosses them: a recomputed op's that an op not
        recomputed saves, and (not counted as saved already) an op's that a recomputed
        one reads, to run again (the logits into a recomputed loss)."""
        tp, sequence = k.tp, k.sequence
        key = (tp, sequence, k.recompute, k.coshard)
        if key not in self._kept_across:
            again, choice, m = self.again(k), self.choice(tp, sequence), Mesh((tp,))
            out = np.zeros(len(self.ops))
            for i, op in enumerate(self.ops):
                if op not in choice:
                    continue
                for t, lay in zip(op.outputs, choice[op].outputs):
                    if t in self.views or not again[i] and t in self.saved:
                        continue
                    readers = [(r, j) for u in self.storage.get(t, [t])
                               for r, j in self.readers.get(u, ())]
                    if any(again[r] != again[i] and (again[r] or (
                            kept := self.saves.get(self.ops[r])) is not None and j in kept.inputs)
                           for r, j in readers):
                        out[i] += self._bytes(t) / sharded(lay, m)
            self._kept_across[key] = out
        return self._kept_across[key]

    def shared(self, tp: int, sequence: bool) -> list[tuple[int, int, float, bool]]:
        """(first reader, later reader, bytes, whole) of each weight an op reads after
        another (a tied embedding): on another stage it holds its own copy, gradient and
        state; ``whole``: each of the stage's devices reads all of it."""
        key = (tp, sequence)
        if key not in self._shared:
            choice, m = self.choice(tp, sequence), Mesh((tp,))
            self._shared[key] = [
                (first, reader, self.states * math.prod(t.shape) * t.dtype.itemsize / parts,
                 parts == 1)
                for reader, i, first in self.later
                if (op := self.ops[reader]) in choice and (t := op.inputs[i])
                and (parts := sharded(choice[op].inputs[i], m))]
        return self._shared[key]

    def _bytes(self, t: PTensor) -> float:
        return math.prod(t.shape) * self.kept.get(t, t.dtype.itemsize)

    def times(self, tp: int, sequence: bool, m: int) -> np.ndarray:
        """Each op's seconds on ``1 / m`` of the batch: compute and layout changes."""
        key = (tp, sequence, m)
        if key not in self._times:
            self._times[key] = np.array(op_seconds(self.graph, self.choice(tp, sequence),
                                                   Mesh((tp,)), self.cluster, m))
        return self._times[key]

    def stage_of(self, stages_: int, micro_batched: bool) -> np.ndarray:
        key = (stages_, micro_batched)
        if key not in self._stages:
            cut = stages(self.graph, stages_, micro_batched=micro_batched)
            self._stages[key] = np.array([cut[op] for op in self.ops])
        return self._stages[key]

    def recycled(self, pp: int) -> np.ndarray:
        """Each op's stage under 3F1B: ``k * pp + s`` for stage ``s`` of pass ``k``."""
        if pp not in self._recycled:
            cut = recycled_stages(self.graph, pp)[0]
            self._recycled[pp] = np.array([cut[op] for op in self.ops])
        return self._recycled[pp]

    def schedules(self, pp: int) -> list[tuple[int, bool, bool]]:
        """(chunks, zero bubble, recycle) of the pipeline schedules tried over ``pp`` stage
        ranks: 1F1B, ZB-H1, interleaved and, for a model that runs itself again, 3F1B."""
        if pp == 1:
            return [(1, False, False)]
        recycling = [(self.passes, False, True)] if self.passes > 1 else []
        return [(c, z, False) for c, z in SCHEDULE_KNOBS] + recycling

    def recomputed(self, how: str | None) -> np.ndarray:
        if how not in self._recomputed:
            ops = set(checkpointed(self.graph, how, "recompute", self.batch_dim, self.keep))
            self._recomputed[how] = np.array([op in ops for op in self.ops], dtype=bool)
        return self._recomputed[how]

    def cosharded(self, tp: int, coshard: int) -> np.ndarray:
        """Per op, whether co-shard runs it in ``coshard`` parts, each made again before its
        backward: the runs of ops cut ``tp * coshard`` ways that end in a sum
        (``policies.mesh``'s spans: attentions, MLPs)."""
        key = (tp, coshard)
        if key not in self._cosharded:
            ops = _spans(self.graph, tensor_parallel_dims(self.graph, tp * coshard)) \
                if coshard > 1 else {}
            self._cosharded[key] = np.array([op in ops for op in self.ops], dtype=bool)
        return self._cosharded[key]

    def coshards(self, tp: int) -> list[int]:
        """1, and the co-shard parts (2, 4) that leave something to run in parts."""
        return [1] + [c for c in (2, 4) if self.cosharded(tp, c).any()]

    def again(self, k: Knobs) -> np.ndarray:
        """Per op, whether its backward makes its activations again: recomputed, or one
        co-shard part of it at a time."""
        return self.recomputed(k.recompute) | self.cosharded(k.tp, k.coshard)

    def sends(self, k: Knobs, m: int, stage_of: np.ndarray) -> float:
        """Seconds of one micro-batch's messages between consecutive stages on the
        slowest boundary, forward and back: every tensor-parallel rank sends its copy (a
        slice under sequence parallelism), across nodes sharing their networks."""
        key = (k.tp, k.pp, k.chunks, k.sequence, m, k.micro > 1, k.cp)
        if key not in self._sends:
            worst = 0.0
            bounds = np.flatnonzero(np.diff(stage_of)) + 1
            width = k.cp * k.tp  # the devices of a stage, each sending its own part
            for v, at in enumerate(bounds):
                size = self._crossing(int(at)) / m / (k.tp if k.sequence else 1) / k.cp
                a, b = v % k.pp, (v + 1) % k.pp
                worst = max(worst, self.cluster.transfer(
                    [(a * width + j, b * width + j, size) for j in range(width)]))
            self._sends[key] = worst
        return self._sends[key]

    def _crossing(self, at: int) -> float:
        """Bytes a stage boundary before op ``at`` sends per whole batch, both ways."""
        if at not in self._crossed:
            self._crossed[at] = sum(crossing_bytes(self.graph, at, self.needs_grad))
        return self._crossed[at]

    # ---- a point ---------------------------------------------------------------------

    def price(self, k: Knobs) -> Priced:
        m = k.dp * k.micro  # micro-batches of the whole batch
        share = np.where(self.along, 1 / k.cp, 1.0)  # of each op, what one device does
        terms = self.terms(k.tp, k.sequence) * share[:, None] ** _ALONG
        if k.ep > 1:  # each device keeps its share of the experts' weights
            terms = terms * np.where(self.expert_weights, 1 / k.ep, 1.0)[:, None] ** _WEIGHTS
        stage_of = self.recycled(k.pp) if k.recycle else \
            self.stage_of(k.pp * k.chunks, k.micro > 1)
        rank_of = stage_of % k.pp
        again = self.again(k)
        # a co-shard part's backward holds and makes again its part alone
        parts = np.where(self.cosharded(k.tp, k.coshard), k.coshard, 1)
        context, gathered = self.context(k, m)
        routed, gathered_tokens = self.routed(k, m)
        context, gathered = context + routed, gathered + gathered_tokens
        seconds = self.times(k.tp, k.sequence, m) * share + again * terms[:, 0] / 3 / m \
            + context
        swapped = self.recomputed("full") if k.swap else np.zeros(len(self.ops), dtype=bool)
        out = np.where(swapped, terms[:, 1] / m + terms[:, 2], 0.0)  # to the host and back
        if k.swap:
            seconds = seconds + 2 * out / self.cluster.host_bandwidth
        per_rank = np.bincount(rank_of, weights=seconds, minlength=k.pp)
        if k.pp > 1:  # a micro-batch's round trip to the last stage and back waits on
            # (pp - 1) / pp of its sends per micro-batch on stage rank 0, which the others
            # wait for in turn (1F1B runs only pp - r micro-batches ahead on rank r)
            per_rank = per_rank + k.chunks * self.sends(k, m, stage_of) * (k.pp - 1) / k.pp
        slowest = per_rank.max()
        # the fill and drain: interleaving shortens them by its chunks, zero bubble runs
        # the weight gradients (a third of a rank's time) in them
        step = k.micro * slowest + (per_rank.sum() - slowest) / k.chunks / (
            3 if k.zero_bubble else 1)
        sync = np.bincount(rank_of, weights=terms[:, 4], minlength=k.pp)
        states = np.bincount(rank_of, weights=terms[:, 3], minlength=k.pp)
        grads = np.bincount(rank_of, weights=terms[:, 5], minlength=k.pp)
        # a tied weight's copy on another stage: (first reader, rank) -> (bytes, whole)
        copies: dict[tuple[int, int], tuple[float, bool]] = {}
        for first, reader, nbytes, whole in self.shared(k.tp, k.sequence):
            if rank_of[first] != rank_of[reader]:
                at = (first, int(rank_of[reader]))
                copies[at] = max(copies.get(at, (0.0, whole)), (nbytes, whole))
        for (first, r), (nbytes, whole) in copies.items():  # the copy and its state kept;
            # its gradient summed with the first reader's stage (all their devices at once
            # where each reads all of it), reduced over the replicas and updated there too
            grad = nbytes / self.states
            f = int(rank_of[first])
            pairs = [(f * k.tp + j, r * k.tp + j) for j in range(k.tp)]
            tie = self.cluster.collective("all_reduce", grad, [
                tuple(d for pair in pairs for d in pair)] if whole else pairs)
            states[r] += nbytes
            grads[r] += grad
            sync[r] += tie + OPTIMIZER_PASSES * grad / self.cluster.copy_bandwidth
            sync[f] += tie
        if k.zero3:  # weights, gradients and state 1 / dp each; a layer's weights gathered
            # for its forward and again for its backward, its gradient reduce-scattered
            # (over the replicas of each tensor-parallel shard at once; over the devices
            # of every replica where each tensor-parallel rank reads a weight whole),
            # beside two thirds of the compute (as the simulator finds it where they are
            # the longer), but for the largest layer's, which has none before it to hide in
            weights = float(states[0]) / self.states
            whole = np.bincount(self.units, weights=terms[:, 9])
            cut = np.bincount(self.units, weights=terms[:, 5]) - whole
            groups = [tuple(i * k.tp + j for i in range(k.dp)) for j in range(k.tp)]
            every = [tuple(range(k.devices))]
            gather, scatter = (np.array([
                sum(self.cluster.collective(kind, size, over)
                    for size, over in ((c, groups), (w, every)) if size)
                for c, w in zip(cut, whole)]) for kind in ("all_gather", "reduce_scatter"))
            update = OPTIMIZER_PASSES * weights / self.cluster.copy_bandwidth
            hidden, lump = self.cluster.overlap * step, int(gather.argmax())
            step += max(2 * gather.sum() + scatter.sum() - hidden * 2 / 3,
                        max(gather[lump], gather.sum() - hidden / 3) + max(
                            gather[lump] + scatter[lump],
                            gather.sum() + scatter.sum() - hidden * 2 / 3))
            sync = np.array([update / k.dp])
            states = states / k.dp
            per_unit = np.bincount(self.units, weights=terms[:, 3] / self.states)
            states = states + per_unit.max(initial=0.0)  # the largest layer, gathered
        elif k.shard:  # each replica updates and keeps the state of 1 / dp of the weights
            weights = states / self.states
            states = states - weights * (self.states - 2) * (1 - 1 / k.dp)
            sync = sync - OPTIMIZER_PASSES * weights / self.cluster.copy_bandwidth * (
                1 - 1 / k.dp)
        sync = sync.max()
        if k.dp * k.cp > 1 and not k.zero3:  # stage rank r's last backward ends r chunk backwards
            # before stage rank 0's (none for zero bubble, whose weight gradients fill the
            # drain)
            ahead = np.arange(k.pp) * (0.0 if k.zero_bubble else 2 / 3 * slowest / k.chunks)
            sync += self.reduced(k, grads, ahead)
        # what the backward keeps: a recomputed op's outputs and weight copies are made
        # again, but not its inputs read in another layout than made (gathered copies),
        # which it keeps to run again whether its backward saves them or not
        kept = np.where(again, terms[:, 8] / m, terms[:, 1] / m + terms[:, 2] + terms[:, 7] / m) \
            + self.kept_across(k) / m - out
        per_micro = np.bincount(stage_of, weights=kept, minlength=k.pp * k.chunks)
        # the backward's working set, a swapped op's saved tensors brought back for its
        # backward, and a recomputed layer's made again (a zero-bubble backward keeps every
        # layer's for its later weight gradients)
        remade = np.where(again, terms[:, 1] / m + terms[:, 2], 0.0) / parts
        holds = terms[:, 6] / parts
        transient = [holds[rank_of == r].max(initial=0.0) / m + out[rank_of == r].max(
            initial=0.0) + gathered[rank_of == r].max(initial=0.0) + (
            remade[rank_of == r].sum() if k.zero_bubble else np.bincount(
                self.units[rank_of == r], weights=remade[rank_of == r]).max(initial=0.0))
            for r in range(k.pp)]
        memory = np.array([states[r] + self._held(k, r, per_micro) + transient[r]
                           for r in range(k.pp)])
        fullest = int(memory.argmax())
        return Priced(k, float(step + sync), float(memory[fullest]),
                      float(states[fullest]), fullest)

    def sharing(self, dp: int) -> list[int]:
        """The expert-parallel groups of ``dp`` replicas the graph's experts share out over:
        1, and powers of two dividing ``dp`` and every experts op's count of experts."""
        if not self.experts:
            return [1]
        counts = [self.ops[i].inputs[3].shape[0] for i in self.experts]
        return [e for e in (2 ** i for i in range(dp.bit_length()))
                if dp % e == 0 and all(c % e == 0 for c in counts)]

    def contexts(self, devices: int, tp: int) -> list[tuple[int, str]]:
        """The context-parallel groups (and how their attention meets) over at most
        ``devices``, beside ``tp``, that the graph's sequence and heads take: chunks of at
        least ``MIN_CHUNK`` tokens, and for Ulysses heads that ``cp * tp`` divides. Keys
        gathered whole are no point of their own: round a ring they hold the same and are
        priced no slower (``context``)."""
        out = [(1, "allgather")]
        if not self.attention:
            return out
        heads = min(self.ops[i].inputs[1].shape[-3] for i in self.attention
                    if len(self.ops[i].inputs[1].shape) >= 3) if self.attention else 0
        cp = 2
        while cp <= devices and devices % cp == 0:
            try:
                made = context(self.graph, cp)
            except PlanError:
                break
            if self.length // made.chunks < MIN_CHUNK:
                break
            out.append((cp, "ring"))
            if heads % (cp * tp) == 0:
                out.append((cp, "ulysses"))
            cp *= 2
        return out

    def context(self, k: Knobs, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Per op, on one of ``m`` micro-batches: the seconds context parallelism's exchanges
        add to each attention (forward and backward), and the bytes they hold while it runs
        its backward (its keys and values gathered again, their gradients before they are
        reduce-scattered; for Ulysses none but its own)."""
        seconds, held = np.zeros(len(self.ops)), np.zeros(len(self.ops))
        if k.cp == 1:
            return seconds, held
        width = k.cp * k.tp
        groups = [tuple(c * k.tp + j for c in range(k.cp)) for j in range(k.tp)]
        for i in self.attention:
            q, key, value = self.ops[i].inputs[:3]
            kv = (self._bytes(key) + self._bytes(value)) / k.tp / m  # one group's whole
            if k.attention == "ulysses":  # each device's chunks of query, keys, values,
                # output: both ways
                chunk = (self._bytes(q) * 2 + self._bytes(key) + self._bytes(value)) / width / m
                seconds[i] = 2 * self.cluster.collective("all_to_all", chunk, groups)
                continue
            gather = self.cluster.collective("all_gather", kv, groups)
            scatter = self.cluster.collective("reduce_scatter", kv, groups)
            if k.attention == "ring":  # the forward's blocks land as its rows attend to
                # those in place (a third of the attention's time), and the backward's
                # gradients leave as it makes them (the other two), as the simulator has it
                attention = self.times(k.tp, k.sequence, m)[i] / k.cp
                seconds[i] = max(0.0, gather - attention / 3) + \
                    max(0.0, scatter - 2 * attention / 3)
            else:
                seconds[i] = gather + scatter
            seconds[i] += gather  # gathered again for the backward
            held[i] = 2 * kv
        return seconds, held

    def routed(self, k: Knobs, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Per op, on one of ``m`` micro-batches: the seconds expert parallelism adds to each
        experts op (an all-to-all of the rows routed to each member's experts and one back
        with their outputs, forward; the outputs' gradients and the tokens', backward),
        and what it holds while it runs (the rows that came and their outputs). A token
        reaches a member holding ``e / ep`` of the ``e`` experts with the chance that one
        of its ``k`` picks is one of them (a router that spreads the tokens evenly)."""
        seconds, held = np.zeros(len(self.ops)), np.zeros(len(self.ops))
        if k.ep == 1:
            return seconds, held
        unit = k.pp * k.cp * k.tp  # one data-parallel replica's devices
        groups = [tuple(i * unit + j for i in range(k.ep)) for j in range(unit)]
        for i in self.experts:
            op = self.ops[i]
            experts = op.inputs[3].shape[0]
            tokens = self._bytes(op.inputs[0]) / (k.dp * m * k.cp)  # one replica's
            # each member's rows for the whole group, as an all-to-all counts what it holds
            rows = tokens * reach(experts, experts // k.ep, op.inputs[1].shape[-1]) * k.ep
            seconds[i] = 4 * self.cluster.collective("all_to_all", rows, groups)
            held[i] = 2 * rows * (k.ep - 1) / k.ep
        return seconds, held

    def reduced(self, k: Knobs, grads: np.ndarray, ahead: np.ndarray) -> float:
        """Seconds after the backward until each stage rank's gradients (``grads`` bytes)
        are reduced over the replicas, stage rank r starting ``ahead[r]`` seconds early:
        every stage's groups at once, but where they cross nodes, the groups of all stages
        on a node take turns on its network as they come (as the simulator runs them)."""
        r, width = int(grads.argmax()), k.cp * k.tp  # a stage rank's devices
        groups = [tuple((i * k.pp + r) * width + c * k.tp + j for i in range(k.dp)
                        for c in range(k.cp)) for j in range(k.tp)]
        alone = self.cluster.collective("all_reduce", grads[r], groups) if not k.shard \
            else self.cluster.collective("reduce_scatter", grads[r], groups) + \
            self.cluster.collective("all_gather", grads[r], groups)
        touched = self._networks(k)
        if not touched.any():
            return alone
        seconds = alone * grads / grads[r]
        end = alone
        for node in touched.T:
            t = -math.inf
            for s in sorted(np.flatnonzero(node), key=lambda s: -ahead[s]):
                t = max(t, -ahead[s]) + seconds[s]
            end = max(end, t)
        return float(end)

    def _networks(self, k: Knobs) -> np.ndarray:
        """(stage rank, node): whether a replica group of that stage rank crosses nodes
        and has a member on that node; one column per kind of node."""
        key = (k.dp, k.tp, k.pp, k.cp)
        if key not in self._networks_of:
            devices = np.arange(k.devices).reshape(k.dp, k.pp, k.cp * k.tp)
            nodes = devices // self.cluster.per_node
            touched = np.zeros((k.pp, int(nodes.max()) + 1), dtype=bool)
            crossing = (nodes != nodes[:1]).any(axis=0)  # (stage rank, tp index)
            for r in range(k.pp):
                if crossing[r].any():
                    touched[r, nodes[:, r, :].ravel()] = True
            self._networks_of[key] = np.unique(touched, axis=1)  # nodes alike priced once
        return self._networks_of[key]

    @staticmethod
    def _held(k: Knobs, rank: int, per_micro: np.ndarray) -> float:
        """Bytes of activations rank ``rank`` keeps at once in its schedule's order: what
        one micro-batch keeps in each of its stages, from its forward to its backward, as
        the plan's estimate counts them (``plan.steps``)."""
        mine = per_micro[rank::k.pp]  # its stages: one per chunk
        if k.micro == 1:
            return float(mine.sum())
        return float((_alive(rank, k.pp, k.micro, k.chunks, k.schedule) @ mine).max())


def _recycling(graph: Graph, needs_grad: set[PTensor]) -> int:
    """How often the model runs itself a step, the passes before the last without
    gradients (recycling, which 3F1B pipelines); 1 for any other model (one that calls a
    module again within its pass of gradients: T5's shared embedding)."""
    stage, passes = recycled_stages(graph, 1)
    if any(stage[op] < passes - 1 and t in needs_grad for op in graph.ops for t in op.outputs):
        return 1
    return passes


def _served(op: Op, made_for: dict[Op, Op]) -> Op:
    """The op ``op`` makes weights for, through ``feeders`` (``op`` itself if none)."""
    while op in made_for:
        op = made_for[op]
    return op


def _blocks(graph: Graph) -> int:
    """How many blocks a pipeline may cut the model into: its repeated layers (modules
    numbered ``h.0``, ``h.1``, ...), else the places where the fewest activations cross."""
    layers = {m.group(0) for op in graph.ops if op.source and
              (m := re.match(r"^(.*?\.)?\d+(?=\.|$)", op.source.module))}
    if layers:
        return len(layers)
    inner = _crossing(graph.ops)[1:-1]
    return 1 + sum(c == min(inner) for c in inner) if inner else 1


@lru_cache(maxsize=65536)
def _order(rank: int, pp: int, micro: int, chunks: int, schedule: str | None = None) -> tuple:
    """Rank ``rank``'s steps. Past a few rounds of ``pp`` micro-batches the order repeats:
    what is alive at once no longer grows (``micro`` a multiple of ``pp``, as the points
    are)."""
    run = SCHEDULES[schedule or ("interleaved" if chunks > 1 else "1f1b")]
    return tuple(run(rank, pp, min(micro, pp * (chunks + 3)), chunks))


@lru_cache(maxsize=65536)
def _alive(rank: int, pp: int, micro: int, chunks: int, schedule: str) -> np.ndarray:
    """Rank ``rank``'s order's live micro-batches per stage (``plan.steps.live_counts``:
    its stages ``rank + c * pp`` in chunk order), the distinct rows only: the bytes alive
    at once are the most of this times what one keeps per stage."""
    return np.unique(live_counts(_order(rank, pp, micro, chunks, schedule))[1], axis=0)


def points(model: Model, devices: int, per_node: int, replicas: bool = False
           ) -> Iterator[Knobs]:
    """Every point over ``devices``: tensor parallelism within a node, pipelines up to
    a stage per block, micro-batches dividing each replica's rows; with ``replicas`` (data
    parallelism built as replicas of one group), the optimizer state sharded over them."""
    graph = model.graph
    attention = any(op.kind == "attention" for op in graph.ops)
    for tp in (t for t in (2 ** i for i in range(devices.bit_length()))
               if devices % t == 0 and t <= per_node):
        if tp > 1 and not any(s.algos != (Replicate(tp),)
                              for s in model.choice(tp, False).values()):
            continue  # nothing to cut
        for cp, way in model.contexts(devices // tp, tp):
            inner = tp * cp
            for pp in (p for p in range(1, min(devices // inner, model.blocks) + 1)
                       if (devices // inner) % p == 0):
                dp = devices // (inner * pp)
                if model.batch % dp:
                    continue
                rows = model.batch // dp
                for ep, micro in ((e, m) for e in model.sharing(dp)
                                  for m in range(1, rows + 1) if rows % m == 0):
                    for chunks, zero_bubble, recycle in model.schedules(pp):
                        if chunks > 1 and not recycle and (micro % pp or
                                                           pp * chunks > model.blocks):
                            continue
                        if zero_bubble and micro < pp:
                            continue  # nothing to fill the bubble with
                        for recompute, swap in KEPT:
                            if recompute == "selective" and not attention or \
                                    swap and not model.cluster.host_bandwidth:
                                continue
                            # co-shard: unfolded, so tried without stages or context,
                            # experts or sequence parallelism (whose cuts it would change)
                            alone = pp == 1 and cp == 1 and ep == 1 and not swap
                            parts = model.coshards(tp) if alone else [1]
                            for sequence, coshard in [(False, c) for c in parts] + \
                                    [(True, 1)] * (tp > 1):
                                for shard in (False, True) if dp > 1 and replicas else (False,):
                                    yield Knobs(dp, tp, pp, micro, chunks, recompute,
                                                sequence, shard, zero_bubble, swap, cp=cp,
                                                attention=way, ep=ep, coshard=coshard,
                                                recycle=recycle)
                if pp == 1 and dp > 1 and cp == 1 and devices <= ZERO3_UP_TO:  # one plan
                    yield Knobs(dp, tp, 1, 1, zero3=True)  # of every device
