"""Measure this machine's devices and links: alpha and bandwidth per collective.

``profile`` spawns one process per device (gloo on CPU, NCCL on GPU), times
each collective as generated code calls it (through the step context and the
transport a rank uses) over a range of sizes, and fits
``seconds = alpha * steps + bytes * volume / bandwidth`` with the ring factors
of ``cost.network``. Calls are made as a step makes them, with no barrier
between them, so their time holds the members' arrival skew: once back to
back, once each after ``busy`` seconds of compute on every member (a matmul
over a few MB, as a layer's); on CPUs the second kind waits longer for cores
and caches. A call's time is the mean of its repeats, not the median, as a step
adds its calls up, rare slow ones included. It also times a matmul (peak
FLOP/s), a copy (memory bandwidth), and an all-reduce started beside a layer's
matmuls against each alone: what share of communication runs beside compute at
no cost to it (``Cluster.overlap``; on CPUs both take the same cores). The
result is a ``Cluster`` that ``save_profile`` writes as JSON for ``--cluster FILE``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from functools import partial

import torch
import torch.distributed as dist

from chronotope.cost.network import KINDS, Cluster, Link, steps_and_volume
from chronotope.measure.ops import call_times
from chronotope.runtime.context import StepContext
from chronotope.runtime.launch import spawn
from chronotope.runtime.transport import DistTransport

SIZES = tuple(2 ** k for k in range(12, 25, 2))  # bytes per member: 4 KiB .. 16 MiB


def profile(devices: int = 2, sizes: tuple[int, ...] = SIZES, repeats: int = 5,
            backend: str = "gloo", timeout: float = 120.0, busy: float = 3e-3) -> Cluster:
    """Measure ``devices`` local processes and fit the cost model to them."""
    results = spawn(_measure, devices, (sizes, repeats, backend, timeout, busy), backend,
                    timeout)

    counts = [_repeats_at(n, repeats) for n in sizes]

    def fitted(mode: str) -> dict[str, Link]:
        # The slowest member's time: it holds the members' arrival skew, as collectives
        # within a training step do. A message is timed by its two ends. An all-gather's
        # bytes are what each member holds after it, as ``Cluster.collective`` counts them.
        return {kind: fit(kind, devices, tuple(
            n * devices if kind == "all_gather" else n for n in sizes), [
            max(r[mode][kind][i] for r in (results[:2] if kind == "send" else results))
            for i in range(len(sizes))], counts) for kind in KINDS}

    back_to_back, after = fitted("back_to_back"), fitted("busy")
    first = results[0]
    name = f"profile:{platform.node() or 'local'}:{backend}x{devices}"
    return Cluster(name, 1, devices, {"float32": first["flops"]}, first["memory"],
                   first["copy_bandwidth"], intra=back_to_back["send"],
                   inter=back_to_back["send"], fitted=back_to_back, fitted_busy=after,
                   busy=busy, overlap=statistics.median(r["overlap"] for r in results))


def fit(kind: str, k: int, sizes: tuple[int, ...], seconds: list[float],
        repeats: list[int] | None = None) -> Link:
    """Least squares of ``seconds = alpha * steps + bytes * volume / bandwidth`` in
    absolute errors, as a step's time adds them up: a late wake-up costs the same at any
    size, so each mean weighs as many as the calls it averages."""
    steps, volume = steps_and_volume(kind, 2 if kind == "send" else k)
    xs = [n * volume for n in sizes]
    w = repeats or [1] * len(sizes)
    total = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / total
    my = sum(wi * y for wi, y in zip(w, seconds)) / total
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, seconds)) / sxx \
        if sxx else 0.0
    slope = max(slope, 1e-15)  # a link is never infinitely fast
    intercept = max(my - slope * mx, 0.0)
    return Link(intercept / steps if steps else 0.0, 1.0 / slope)


def _repeats_at(nbytes: int, repeats: int) -> int:
    """Rare slow calls weigh less on long ones: fewer repeats above 1 MiB."""
    return max(3, repeats * 2 ** 20 // max(nbytes, 2 ** 20))


def save_profile(cluster: Cluster, path: str) -> None:
    with open(path, "w") as f:
        json.dump(cluster.to_json(), f, indent=1)


def _measure(rank: int, sizes, repeats: int, backend: str, timeout: float,
             busy: float) -> dict:
    world = dist.get_world_size()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") \
        if backend == "nccl" else torch.device("cpu")
    members = tuple(range(world))
    transport = DistTransport(timeout, [members])
    rt = StepContext(rank, device, {}, {}, {}, {}, transport, {})
    times: dict[str, dict[str, list[float]]] = {
        mode: {kind: [] for kind in KINDS} for mode in ("back_to_back", "busy")}
    acts, weight = torch.randn(1024, 256, device=device), torch.randn(1024, 256, device=device)
    matmuls = max(1, round(busy / _median(lambda: acts @ weight.T, 3, device)))

    def compute() -> None:
        for _ in range(matmuls):
            acts @ weight.T
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for nbytes in sizes:
        times_each = _repeats_at(nbytes, repeats)
        x = torch.randn(max(world, nbytes // 4) // world * world, device=device)
        calls = {  # as generated code calls them, the step context's copies included
            "send": partial(_ping, rt, x),
            "all_reduce": partial(rt.all_reduce, [(x,)], members),
            "all_gather": partial(rt.all_gather, [x], members, (0,)),
            "reduce_scatter": partial(rt.reduce_scatter, [(x,)], members, (0,)),
            "all_to_all": partial(rt.all_to_all, x, members, 0, members, 0),
            "broadcast": partial(rt.broadcast, x if rank == 0 else None, 0, members,
                                 tuple(x.shape), x.dtype),
        }
        for kind, call in calls.items():
            times["back_to_back"][kind].append(_mean_after(None, call, times_each, device))
            times["busy"][kind].append(_mean_after(compute, call, times_each, device))
    return {**times, "flops": matmul_flops(device), "copy_bandwidth": _copy(device),
            "memory": _memory(device, world), "overlap": _overlap(rt, compute, repeats, device)}


def _overlap(rt: StepContext, compute, repeats: int, device: torch.device,
             nbytes: int = 2 ** 22, trials: int = 5) -> float:
    """The share of an all-reduce that runs beside compute at no cost to it: the time an
    all-reduce and a layer's matmuls take started together, against each alone (1: the
    longer of the two; 0: one after the other)."""
    x = torch.randn(nbytes // 4, device=device)
    members = tuple(range(dist.get_world_size()))

    def alone() -> None:
        rt.all_reduce([(x,)], members, async_op=True).wait()

    def both() -> None:
        started = rt.all_reduce([(x,)], members, async_op=True)
        compute()
        started.wait()

    def share() -> float:
        comm, work, together = (_mean_after(None, call, repeats, device)
                                for call in (alone, compute, both))
        shorter = min(comm, work)
        return min(1.0, max(0.0, (comm + work - together) / shorter)) if shorter > 0 else 1.0

    return statistics.median(share() for _ in range(trials))  # a noisy share: the typical one


def _ping(rt: StepContext, x: torch.Tensor) -> None:
    """Rank 0 sends to rank 1 (the others go on)."""
    if rt.rank == 0:
        rt.send(x, 1, 7)
        rt.transport.flush()
    elif rt.rank == 1:
        rt.recv(tuple(x.shape), x.dtype, 0, 7)


def _mean_after(compute, call, repeats: int, device: torch.device) -> float:
    """Mean seconds of ``call``, each made right after ``compute`` (if any)."""
    call()  # warm up (and make any lazily made communicator)
    dist.barrier()
    return statistics.mean(call_times(call, repeats, device, compute))


def _median(call, repeats: int, device: torch.device) -> float:
    """The typical time of a call on this device alone (a matmul, a copy)."""
    call()
    return statistics.median(call_times(call, repeats, device))


def matmul_flops(device: torch.device | str = "cpu", n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of a square matmul here (in a profile: every device busy at once)."""
    device = torch.device(device)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n ** 3 / _median(lambda: a @ b, repeats, device)


def _copy(device: torch.device, nbytes: int = 2 ** 26, repeats: int = 5) -> float:
    x = torch.empty(nbytes // 4, device=device)
    return 2 * nbytes / _median(lambda: x.clone(), repeats, device)  # read and write


def _memory(device: torch.device, world: int) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(pages) / world  # the processes share this machine's memory

