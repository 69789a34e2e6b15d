"""What a step costs beyond its pieces' op times on this machine.

``calibrate`` times every instruction of one device's step as the runtime runs
it (generated code with ``rt.tick()``) and fits what a step costs beyond those
op times: a fixed cost per instruction kind, per piece an autograd call runs
through, per byte assembled and per parameter byte the optimizer updates.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
import torch.distributed as dist

from chronotope.compile import compile
from chronotope.compile.codegen import render
from chronotope.compile.program import Free
from chronotope.compile.simulate import features, instruction_compute
from chronotope.cost.times import Calibration, OpTime, piece_seconds
from chronotope.graph.ir import Graph
from chronotope.policies import mesh
from chronotope.runtime.launch import spawn
from chronotope.runtime.local import Optim, Rank, rank_specs
from chronotope.runtime.transport import ThreadTransport
from chronotope.workload import Workload


def calibrate(graph: Graph, workload: Workload, times: dict[str, OpTime], steps: int = 5,
              processes: int = 1) -> Calibration:
    """Fit ``Calibration`` to each instruction of one device's step, run whole and in
    micro-batches (the same work in more, smaller instructions), timed as the runtime
    runs it; with ``processes``, that many run at once, sharing the cores as workers do."""
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
            measured = instruction_compute(ins, lambda op: piece_seconds(op, times))
            rows.append((*features(ins), measured))
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
