"""Benchmarks the CLI runs: layout changes (``chronotope bench rvd``).

The RVD cases are SuperScaler's Table 3: six categories of layout change of a
1-D tensor, each from i producers on one node to j consumers on another (8->8,
8->4, 4->8), priced by the cost model for plain point-to-point messages and for
the searched path. Measured, they run on gloo processes with smaller tensors,
and the same changes within one device set also through DTensor's
``redistribute``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from chronotope.compile.rvd import RVD, Layout
from chronotope.compile.rvd_search import Path, p2p, search
from chronotope.cost.network import Cluster
from chronotope.runtime.launch import spawn
from chronotope.runtime.redistribute import pieces_of, run_paths

CATEGORIES = (("R", "R"), ("R", "D"), ("V", "R"), ("V", "D"), ("D", "R"), ("D", "D"))
CONFIGS = ((8, 8), (8, 4), (4, 8))
PAPER_WINS = "12 of 18, up to 57x"  # SuperScaler section 6.5, Figure 17


def _rvd(kind: str, n: int) -> RVD:
    return RVD(n if kind == "R" else 1, n if kind == "V" else 1, (n if kind == "D" else 1,))


def rvd_cases(cluster: Cluster, numel: int, itemsize: int = 4,
              same_devices: bool = False) -> list[dict]:
    """Each case's layouts, and its P2P and searched paths under ``cluster``. Producers
    are the first devices of node 0, consumers the first of node 1 (or, with
    ``same_devices``, the producers again: 8->8 only)."""
    out = []
    configs = ((8, 8),) if same_devices else CONFIGS
    for a, b in CATEGORIES:
        for i, j in configs:
            src = Layout(_rvd(a, i), tuple(range(i)))
            first = 0 if same_devices else cluster.per_node
            dst = Layout(_rvd(b, j), tuple(range(first, first + j)))
            naive = p2p(src, dst, (numel,), itemsize, cluster)
            path = search(src, dst, (numel,), itemsize, cluster)
            arrow = "=" if same_devices else "->"
            out.append({"case": f"{src.rvd}{arrow}{dst.rvd}",
                        "p2p_s": naive.seconds, "rvd_s": path.seconds,
                        "speedup": naive.seconds / path.seconds if path.seconds else 1.0,
                        "path": str(path),
                        "paths": (naive, path)})
    return out


def measure(cases: list[dict], numel: int, repeats: int = 5, backend: str = "gloo",
            dtensor: bool = False) -> None:
    """Run each case's two paths (and DTensor's redistribute) for real; adds the
    measured seconds to each case."""
    paths = [p for c in cases for p in c["paths"]]
    sources = [pieces_of(p.src, [torch.randn(numel) for _ in range(p.src.rvd.v)])
               for p in paths]
    _, seconds = run_paths(paths, (numel,), sources, repeats, backend)
    for k, case in enumerate(cases):
        case["p2p_measured_s"], case["rvd_measured_s"] = seconds[2 * k], seconds[2 * k + 1]
    if dtensor:
        layouts = [(c["paths"][1].src, c["paths"][1].dst) for c in cases]
        world = 1 + max(d for s, t in layouts for d in (*s.devices, *t.devices))
        times = spawn(_redistribute, world, (layouts, numel, repeats), backend)
        for k, case in enumerate(cases):
            case["dtensor_measured_s"] = max(t[k] for t in times)


def _redistribute(rank: int, layouts: list[tuple[Layout, Layout]], numel: int,
                  repeats: int) -> list[float]:
    """DTensor's own redistribute of each layout change, on a mesh of its devices."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    out = []
    for src, dst in layouts:
        shape, before, devices = src.placements()
        _, after, _ = dst.placements()
        mesh = DeviceMesh("cpu", torch.tensor(devices).reshape(shape))
        local = pieces_of(src, [torch.randn(numel) for _ in range(src.rvd.v)])[rank]
        times = []
        for _ in range(repeats):
            x = DTensor.from_local(local, mesh, before, run_check=False)
            dist.barrier()
            start = time.perf_counter()
            x.redistribute(mesh, after).to_local()
            dist.barrier()
            times.append(time.perf_counter() - start)
        out.append(sorted(times)[len(times) // 2])
    return out


def public(case: dict) -> dict:
    """A case as JSON: everything but the path objects."""
    return {k: v for k, v in case.items() if not isinstance(v, tuple | Path)}
