"""Measured compute cost: each op's forward and backward seconds on this machine, and
what the runtime adds to them.

``measure_ops`` runs the captured graph on the workload's real tensors one op at
a time, as the reference executor does, timing each op's forward and the
autograd call that gives its inputs' gradients (the median of ``repeats``), less
what timing a trivial op costs (that call overhead is the runtime's, not the
op's). A plan's piece then costs its op's time times its share of the op's
FLOPs, so timelines and schedules can use the machine's numbers instead of a
peak rate.

``calibrate`` times every instruction of one device's step as the runtime runs
it (generated code with ``rt.tick()``) and fits what a step costs beyond those
op times: a fixed cost per instruction kind, per piece an autograd call runs
through, per byte assembled and per parameter byte the optimizer updates.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from chronotope.cost.compute import op_flops, piece_flops
from chronotope.graph.execute import bind, last_uses, leaves_of, run_op
from chronotope.graph.ir import Graph, Op, PTensor, TensorKind, TensorMeta
from chronotope.models.workload import Workload
from chronotope.plan.plan import PlanOp, differentiable


@dataclass(frozen=True)
class OpTime:
    forward: float  # seconds
    backward: float  # seconds; 0 for an op without gradients to pass


def measure_ops(graph: Graph, workload: Workload, repeats: int = 3,
                processes: int | None = None) -> dict[str, OpTime]:
    """Each op's forward and backward seconds, by op name, less the cost of timing a
    trivial op's call; with ``processes``, on the threads each of that many workers
    sharing this machine's cores gets."""
    threads = torch.get_num_threads()
    if processes is not None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))
    try:
        return _measure_ops(graph, workload, repeats)
    finally:
        torch.set_num_threads(threads)


def _measure_ops(graph: Graph, workload: Workload, repeats: int) -> dict[str, OpTime]:
    grads = differentiable(graph)
    values, device = bind(graph, leaves_of(graph, workload))
    free = last_uses(graph)
    out: dict[str, OpTime] = {}
    with torch.device(device):
        base = _call_cost(device, max(repeats, 21))
        for i, op in enumerate(graph.ops):
            ins = {t: values[t].detach().requires_grad_(t in grads) for t in op.inputs}
            outs = run_op(op, ins, device)
            forward = _median(partial(run_op, op, ins, device), repeats, device)
            made = [o for o in outs if o.requires_grad]
            leaves = [v for t, v in ins.items() if t in grads]
            backward = 0.0
            if made and leaves:
                backward = _median(partial(torch.autograd.grad, made, leaves,
                                           [torch.ones_like(o) for o in made],
                                           retain_graph=True, allow_unused=True),
                                   repeats, device)
            out[op.name] = OpTime(max(0.0, forward - base.forward),
                                  max(0.0, backward - base.backward) if backward else 0.0)
            for t, v in zip(op.outputs, outs):
                values[t] = v.detach()
            for t in free.get(i, ()):
                values.pop(t, None)
    return out


def _call_cost(device: torch.device, repeats: int) -> OpTime:
    """What timing one call costs beyond the op's own work: a negation of one number."""
    x = PTensor("x", TensorMeta((1,), torch.float32), TensorKind.INPUT)
    y = PTensor("y", TensorMeta((1,), torch.float32), TensorKind.ACTIVATION)
    neg = Op("baseline", "neg", torch.neg, (x,), {}, (x,), (y,))
    ins = {x: torch.zeros(1, device=device, requires_grad=True)}
    out = run_op(neg, ins, device)[0]
    return OpTime(_median(partial(run_op, neg, ins, device), repeats, device),
                  _median(partial(torch.autograd.grad, [out], [ins[x]], [torch.ones_like(out)],
                                  retain_graph=True), repeats, device))


def call_times(call: Callable[[], object], repeats: int, device: torch.device,
               before: Callable[[], object] | None = None) -> list[float]:
    """Seconds of ``repeats`` calls, their device work included; ``before`` (untimed)
    runs ahead of each."""
    times = []
    for _ in range(max(1, repeats)):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def _median(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    return statistics.median(call_times(call, repeats, device))


def piece_seconds(piece: PlanOp, times: dict[str, OpTime]) -> float:
    """A forward or backward piece's share of its op's measured time, by FLOPs."""
    op = (piece.forward or piece).op
    measured = times[op.name]
    whole = op_flops(op) * (2 if piece.is_backward else 1)
    share = piece_flops(piece) / whole if whole else 1.0
    return (measured.backward if piece.is_backward else measured.forward) * share


@dataclass(frozen=True)
class Calibration:
    """What a step costs on this machine beyond its pieces' measured op times (scaled by
    ``compute_scale``: one op at a time with warm caches is not a step): the runtime's
    own work per instruction kind, per piece a backward call runs through, per byte
    an ``Assemble`` writes (None: the cluster's copy speed) and per parameter byte the
    optimizer updates (None: a few passes at the copy speed)."""

    compute_scale: float = 1.0
    overhead: dict[str, float] = field(default_factory=dict)  # seconds, by instruction kind
    per_piece: float = 0.0
    per_byte: float | None = None
    optimizer_per_byte: float | None = None

    def seconds(self, ins: object, compute: float, copy_bandwidth: float) -> float:
        """An instruction run on this rank (no communication) whose pieces' measured
        time is ``compute``."""
        kind, pieces, nbytes = _features(ins)
        per_byte = 1.0 / copy_bandwidth if self.per_byte is None else self.per_byte
        return (self.overhead.get(kind, 0.0) + self.per_piece * pieces + per_byte * nbytes
                + self.compute_scale * compute)


def _features(ins: object) -> tuple[str, int, int]:
    """An instruction's kind (a split backward's weight part is one more autograd call),
    the pieces an autograd call runs through, and the bytes an ``Assemble`` writes."""
    from chronotope.compile.program import Assemble, Backward, WeightGrad

    if isinstance(ins, Backward):
        return "Backward", len(ins.ops) + len(ins.recompute), 0
    if isinstance(ins, WeightGrad):
        return "Backward", 1, 0
    if isinstance(ins, Assemble):
        return "Assemble", 0, 0 if ins.is_view else math.prod(ins.shape) * ins.dtype.itemsize
    return type(ins).__name__, 0, 0


def instruction_compute(ins: object, times: dict[str, OpTime] | None,
                        flops_per_s: float) -> float:
    """Seconds of the pieces an instruction runs: their share of ``times``, or their FLOPs
    at ``flops_per_s`` (a recomputing backward runs its forwards again first)."""
    from chronotope.compile.program import Backward, Forward, WeightGrad

    def piece(op: PlanOp) -> float:
        if times is not None and (op.forward or op).op.name in times:
            return piece_seconds(op, times)
        return piece_flops(op) / flops_per_s

    if isinstance(ins, (Forward, WeightGrad)):
        return piece(ins.op)
    if isinstance(ins, Backward):
        return sum(piece(f.op) for f in ins.recompute if isinstance(f, Forward)) + \
            sum(piece(op) for op in ins.ops)
    return 0.0


def calibrate(graph: Graph, workload: Workload, times: dict[str, OpTime], steps: int = 5,
              processes: int = 1) -> Calibration:
    """Fit ``Calibration`` to each instruction of one device's step, run whole and in
    micro-batches (the same work in more, smaller instructions), timed as the runtime
    runs it; with ``processes``, that many run at once, sharing the cores as workers do."""
    from chronotope.compile import compile
    from chronotope.compile.codegen import render
    from chronotope.compile.program import Free
    from chronotope.policies import mesh
    from chronotope.runtime.launch import spawn
    from chronotope.runtime.local import rank_specs

    batch = graph.batch_size or 1
    specs, codes = [], []
    for micro in dict.fromkeys((1, max(k for k in (1, 2, 4) if batch % k == 0))):
        program = compile(mesh(graph, dp=1, micro=micro), comm="p2p")
        spec = rank_specs(program, workload)[0]
        spec.code = render(program, 0, ticks=True)
        specs.append(spec)
        codes.append([ins for ins in program.ranks[0] if not isinstance(ins, Free)])
    runs = spawn(_instruction_times, processes, (specs, steps)) if processes > 1 else \
        [_instruction_times(0, specs, steps)]
    rows, seconds = [], []
    for k, code in enumerate(codes):
        for i, ins in enumerate(code):
            rows.append((*_features(ins), instruction_compute(ins, times, 1.0)))
            seconds.append(statistics.mean(run[k][0][i] for run in runs))
    kinds = sorted({kind for kind, *_ in rows})
    columns = [*kinds, "pieces", "bytes", "compute"]
    x = [[float(kind == k) for k in kinds] + [pieces, nbytes, compute]
         for kind, pieces, nbytes, compute in rows]
    fit = dict(zip(columns, _nonnegative_least_squares(x, seconds)))
    owned = sum(p.meta.nbytes for p in graph.params.values())
    after = statistics.mean(run[k][1] for run in runs for k in range(len(codes)))
    return Calibration(
        compute_scale=fit["compute"], overhead={k: fit[k] for k in kinds},
        per_piece=fit["pieces"],
        per_byte=fit["bytes"] if any(r[2] for r in rows) else None,
        optimizer_per_byte=after / owned if owned else None)


def _nonnegative_least_squares(x: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with every coefficient at least zero: a column whose coefficient
    comes out negative is dropped and the rest solved again. Columns are scaled to
    unit norm first, so seconds and bytes weigh alike."""
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    norms = a.norm(dim=0)
    keep = [j for j in range(a.shape[1]) if norms[j] > 0]
    coef = torch.zeros(a.shape[1], dtype=torch.float64)
    while keep:
        cols = a[:, keep] / norms[keep]
        solved = torch.linalg.lstsq(cols, b.unsqueeze(1), driver="gelsd").solution.squeeze(1)
        solved = solved / norms[keep]
        if (solved >= 0).all():
            coef[keep] = solved
            break
        keep = [j for j, c in zip(keep, solved) if c >= 0]
    return coef.tolist()


def _instruction_times(rank: int, specs: list, steps: int) -> list[tuple[list[float], float]]:
    """For each one-device program (generated with ticks): each instruction's mean seconds
    over ``steps`` steps after a warm-up, and the mean seconds after its last instruction
    (the optimizer step)."""
    import torch.distributed as dist

    from chronotope.runtime.local import Optim, Rank
    from chronotope.runtime.transport import ThreadTransport

    out = []
    for spec in specs:
        worker = Rank(spec, ThreadTransport(), Optim("sgd", 0.0))
        worker.ticks = []
        worker.step()  # warm up
        if dist.is_initialized():
            dist.barrier()  # every process busy at once
        durations, after = [], []
        for _ in range(max(1, steps)):
            worker.ticks = [time.perf_counter()]
            worker.step()
            end = time.perf_counter()
            durations.append([b - a for a, b in itertools.pairwise(worker.ticks)])
            after.append(end - worker.ticks[-1])
        out.append(([statistics.mean(d) for d in zip(*durations)], statistics.mean(after)))
    return out
