"""Layout changes (searched RVD paths) run for real: every rank's piece, and their time.

A path runs as a compiled program runs it: the compiler's instructions for the
change (``compile.layout_changes.Emitter``), rendered by the code generator and
called with a ``StepContext``. ``run_paths`` spawns one process per device (gloo
here, NCCL on GPUs) and carries out each path; ``run_paths_in_threads`` does the
same with threads of this process, for tests. ``pieces_of`` cuts a whole tensor,
given as its value parts, into a layout's pieces, so results can be checked value
for value.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from chronotope.compile.codegen import render_instruction
from chronotope.compile.layout_changes import Emitter
from chronotope.compile.program import Key, Role
from chronotope.compile.rvd import Layout
from chronotope.compile.rvd_search import Path
from chronotope.runtime.context import StepContext
from chronotope.runtime.launch import spawn
from chronotope.runtime.transport import DistTransport, ThreadTransport


def pieces_of(layout: Layout, parts: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each device's piece of a tensor that is the sum of ``parts`` (one per value part
    of the layout, or a single whole tensor that later parts hold as zeros)."""
    shape = tuple(parts[0].shape)
    out = {}
    for device, mask in layout.pieces(shape):
        i, n = mask.value.as_part() or (0, 1)
        part = parts[i] if len(parts) == n else parts[0] if i == 0 else torch.zeros(shape)
        out[device] = part[tuple(slice(a, b) for a, b in mask.index)].clone()
    return out


def path_code(path: Path, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
              ) -> dict[int, str]:
    """Each device's code for ``path``, as the compiler emits a layout change:
    ``run(rt, x)`` takes the device's piece of the source (None where it holds none) and
    returns its piece of the target (None where it holds none)."""
    names: dict[int, set[str]] = defaultdict(set)

    def name(rank: int, hint: str, _shape: tuple[int, ...]) -> str:
        fresh = next(f"{hint}_{i}" for i in itertools.count() if f"{hint}_{i}" not in names[rank])
        names[rank].add(fresh)
        return fresh

    tags = itertools.count(1)
    code, held = Emitter(name, lambda: next(tags)).emit(
        path, "x", dtype, shape, Key("x", (), Role.VALUE, ("path",)),
        dict.fromkeys(path.src.devices, "x"))
    out = {}
    for rank in sorted(set(path.src.devices) | set(path.dst.devices)):
        body = [line for ins in code.get(rank, []) for line in render_instruction(ins)]
        body.append(f"return {held.get(rank)}")
        out[rank] = "import torch\n\n\ndef run(rt, x):\n" + "".join(
            f"    {line}\n" for line in body)
    return out


def run_path(code: str, rank: int, x: torch.Tensor | None, transport,
             device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Run one device's ``path_code``."""
    scope: dict = {}
    exec(compile(code, f"<path on rank {rank}>", "exec"), scope)
    rt = StepContext(rank, torch.device(device), {}, {}, {}, {}, transport, {})
    y = scope["run"](rt, x)
    transport.flush()
    return y


def run_paths_in_threads(path: Path, shape: tuple[int, ...],
                         source: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every device's piece after the path, each device a thread."""
    transport = ThreadTransport(timeout=30.0)
    code = path_code(path, shape)
    out: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(d: int) -> None:
        try:
            y = run_path(code[d], d, source.get(d), transport)
            if y is not None:
                out[d] = y
        except BaseException as e:  # noqa: BLE001 - the others must not wait on it
            errors.append(e)
            transport.fail(d, e)

    threads = [threading.Thread(target=rank, args=(d,)) for d in code]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def run_paths(paths: list[Path], shape: tuple[int, ...], sources: list[dict[int, torch.Tensor]],
              repeats: int = 1, backend: str = "gloo", timeout: float = 60.0,
              ) -> tuple[list[dict[int, torch.Tensor]], list[float]]:
    """Each path on its own processes' pieces; every device's result and the median
    seconds per path (the slowest rank's, from a barrier to a barrier)."""
    world = 1 + max(d for p in paths for d in (*p.src.devices, *p.dst.devices))
    results = spawn(_rank, world, (paths, shape, sources, repeats, backend, timeout), backend,
                    timeout)
    outputs = [{r: res[0][i] for r, res in enumerate(results) if res[0][i] is not None}
               for i in range(len(paths))]
    return outputs, [max(res[1][i] for res in results) for i in range(len(paths))]


def _rank(rank: int, paths: list[Path], shape, sources, repeats: int, backend: str,
          timeout: float) -> tuple[list, list[float]]:
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") \
        if backend == "nccl" else torch.device("cpu")
    transport = DistTransport(timeout, sorted({g for p in paths for g in p.groups()}))
    outs, seconds = [], []
    for path, source in zip(paths, sources):
        code = path_code(path, shape, next(iter(source.values())).dtype).get(rank)
        x = source.get(rank)
        x = x.to(device) if x is not None else None
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            y = run_path(code, rank, x, transport, device) if code is not None else None
            dist.barrier()
            times.append(time.perf_counter() - start)
        outs.append(y.cpu() if y is not None else None)
        seconds.append(sorted(times)[len(times) // 2])
    return outs, seconds
