"""Each op's forward and backward seconds on this machine.

``measure_ops`` runs the captured graph on the workload's real tensors one op at
a time, as the reference executor does, timing each op's forward and the
autograd call that gives its inputs' gradients (the median of ``repeats``), less
what timing a trivial op costs (that call overhead is the runtime's, not the
op's). A plan's piece then costs its op's time times its share of the op's
FLOPs (``cost.piece_seconds``), so timelines and schedules can use the machine's
numbers instead of a peak rate.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from chronotope.cost.times import OpTime
from chronotope.graph.execute import bind, last_uses, leaves_of, run_op
from chronotope.graph.ir import Graph, Op, PTensor, TensorKind, TensorMeta
from chronotope.plan.plan import differentiable
from chronotope.workload import Workload


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
