"""Running a Program: one rank's training state, and all ranks as threads of one process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chronotope.compile.program import Program
from chronotope.graph.capture import Batch
from chronotope.graph.mask import Mask
from chronotope.models.workload import Workload
from chronotope.runtime.context import StepContext
from chronotope.runtime.transport import RankFailed, ThreadTransport

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def sgd(lr: float = 0.1) -> OptimizerFactory:
    return lambda params: torch.optim.SGD(params, lr=lr)


class Rank:
    """One rank: its generated step, its parameter regions and their optimizer."""

    def __init__(self, program: Program, rank: int, workload: Workload, transport: Any,
                 optimizer: OptimizerFactory, device: torch.device | str = "cpu") -> None:
        self.rank = rank
        self.device = torch.device(device)
        self.transport = transport
        graph = program.plan.graph
        self.code = program.code(rank)
        scope: dict[str, Any] = {}
        exec(compile(self.code, f"<chronotope rank {rank}>", "exec"), scope)
        self.step_fn = scope["step"]
        full = dict(workload.model.named_parameters())
        self.params = {
            (name, region.index): nn.Parameter(
                full[name].detach()[region.to_slices()].clone().to(self.device))
            for name, regions in program.held[rank].items() for region in regions
        }
        self.state = {n: b.detach().to(self.device) for n, b in workload.model.named_buffers()}
        self.state.update({n: c.to(self.device) for n, c in graph.constants.items()})
        tensors = Batch.of(workload.inputs, workload.kwargs, workload.targets).tensors()
        self.batch = {t.name: v.to(self.device) for t, v in zip(graph.inputs, tensors)}
        self.targets = {op.name: op.target for op in graph.ops if callable(op.target)}
        self.optimizer = optimizer(list(self.params.values()))

    def step(self) -> list[float]:
        rt = StepContext(self.rank, self.device, self.params, self.state, self.batch,
                         self.transport, self.targets)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            self.step_fn(rt)
        self.transport.flush()
        self.optimizer.step()
        return rt.losses


@dataclass
class RunResult:
    losses: list[float]  # per step, as rank 0 assembled them
    params: dict[str, torch.Tensor]  # final parameters, reassembled from the ranks' regions


def run_in_threads(program: Program, workload: Workload, steps: int,
                   optimizer: OptimizerFactory | None = None, timeout: float = 60.0) -> RunResult:
    """Every rank as a thread of this process: the same generated code, messages in memory."""
    transport = ThreadTransport(timeout)
    optimizer = optimizer or sgd()
    ranks = [Rank(program, r, workload, transport, optimizer) for r in range(program.ndevices)]
    losses: list[float] = []
    errors: dict[int, BaseException] = {}

    def work(rank: Rank) -> None:
        try:
            for _ in range(steps):
                out = rank.step()
                if rank.rank == 0:
                    losses.extend(out)
        except BaseException as e:  # noqa: BLE001  (reported below, after every thread ends)
            errors[rank.rank] = e
            transport.fail(rank.rank, e)

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = min(errors)
        if isinstance(errors[first], RankFailed):
            first = next((r for r, e in sorted(errors.items()) if not isinstance(e, RankFailed)),
                         first)
        raise errors[first]
    return RunResult(losses, gather_params(ranks, workload))


def gather_params(ranks: list[Rank], workload: Workload) -> dict[str, torch.Tensor]:
    """Whole parameters from the regions the ranks hold (replicas agree; any one will do)."""
    out = {n: torch.full_like(p, float("nan")) for n, p in workload.model.named_parameters()}
    for rank in ranks:
        for (name, index), p in rank.params.items():
            out[name][Mask(index).to_slices()] = p.detach().cpu()
    return out
