"""Measured compute cost: each op's forward and backward seconds on this machine.

``measure_ops`` runs the captured graph on the workload's real tensors one op at
a time, as the reference executor does, timing each op's forward and the
autograd call that gives its inputs' gradients (the median of ``repeats``). A
plan's piece then costs its op's time times its share of the op's FLOPs, so
timelines and schedules can use the machine's numbers instead of a peak rate.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from chronotope.cost.compute import op_flops, piece_flops
from chronotope.graph.execute import bind, last_uses, leaves_of, run_op
from chronotope.graph.ir import Graph
from chronotope.models.workload import Workload
from chronotope.plan.plan import PlanOp, differentiable


@dataclass(frozen=True)
class OpTime:
    forward: float  # seconds
    backward: float  # seconds; 0 for an op without gradients to pass


def measure_ops(graph: Graph, workload: Workload, repeats: int = 3) -> dict[str, OpTime]:
    """Each op's forward and backward seconds, by op name."""
    grads = differentiable(graph)
    values, device = bind(graph, leaves_of(graph, workload))
    free = last_uses(graph)
    out: dict[str, OpTime] = {}
    with torch.device(device):
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
            out[op.name] = OpTime(forward, backward)
            for t, v in zip(op.outputs, outs):
                values[t] = v.detach()
            for t in free.get(i, ()):
                values.pop(t, None)
    return out


def _median(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def piece_seconds(piece: PlanOp, times: dict[str, OpTime]) -> float:
    """A forward or backward piece's share of its op's measured time, by FLOPs."""
    op = (piece.forward or piece).op
    measured = times[op.name]
    whole = op_flops(op) * (2 if piece.is_backward else 1)
    share = piece_flops(piece) / whole if whole else 1.0
    return (measured.backward if piece.is_backward else measured.forward) * share



@dataclass(frozen=True)
class Calibration:
    """How a step's time splits on this machine: ``compute_scale`` times the ops'
    measured times (one op at a time overstates a fused backward) plus
    ``per_instruction`` seconds of the runtime's own work for each instruction."""

    per_instruction: float
    compute_scale: float



def calibrate(graph: Graph, workload: Workload, times: dict[str, OpTime], steps: int = 5,
              processes: int = 1) -> Calibration:
    """Fit ``Calibration`` to one device's training step run whole and in micro-batches
    (the same FLOPs in more instructions): two steps, two unknowns. With ``processes``,
    that many run it at once on this machine, sharing its cores as workers do."""
    from chronotope.compile import compile
    from chronotope.compile.program import Backward, Forward, Free, WeightGrad
    from chronotope.policies import mesh
    from chronotope.runtime.launch import spawn
    from chronotope.runtime.local import rank_specs

    batch = graph.inputs[0].shape[0] if graph.inputs and graph.inputs[0].shape else 1
    specs, counts = [], []
    for micro in dict.fromkeys((1, max(k for k in (1, 2, 4) if batch % k == 0))):
        program = compile(mesh(graph, dp=1, micro=micro), comm="p2p")
        specs.append(rank_specs(program, workload)[0])
        code = [ins for ins in program.ranks[0] if not isinstance(ins, Free)]
        pieces = [ins.op for ins in code if isinstance(ins, (Forward, WeightGrad))]
        pieces += [op for ins in code if isinstance(ins, Backward) for op in ins.ops]
        pieces += [f.op for ins in code if isinstance(ins, Backward) for f in ins.recompute
                   if isinstance(f, Forward)]
        counts.append((len(code), sum(piece_seconds(p, times) for p in pieces)))
    if processes > 1:
        runs = spawn(_step_times, processes, (specs, steps))
        seconds = [statistics.mean(r[i] for r in runs) for i in range(len(specs))]
    else:
        seconds = _step_times(0, specs, steps)
    (n1, ops1), (n2, _) = counts[0], counts[-1]
    t1, t2 = seconds[0], seconds[-1]
    per = max(0.0, (t2 - t1) / (n2 - n1)) if n2 != n1 else 0.0
    return Calibration(per, max(0.0, t1 - per * n1) / ops1 if ops1 else 1.0)


def _step_times(rank: int, specs: list, steps: int) -> list[float]:
    """The median step time of each one-device program, run here."""
    import torch.distributed as dist

    from chronotope.runtime.local import Optim, Rank
    from chronotope.runtime.transport import ThreadTransport

    out = []
    for spec in specs:
        worker = Rank(spec, ThreadTransport(), Optim("sgd", 0.0))
        worker.step()  # warm up
        if dist.is_initialized():
            dist.barrier()  # every process busy at once
        out.append(_median(worker.step, steps, torch.device(worker.device)))
    return out
