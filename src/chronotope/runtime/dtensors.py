"""Trained parameters as DTensors: each parameter's regions on the ranks, read as the
placements of a device mesh, so that what chronotope trained goes on in code that speaks
``torch.distributed.tensor`` (a DTensor checkpoint, ``parallelize_module`` inference).

``placements(program)`` works each parameter's layout out once (picklable: it travels to
the ranks); on every rank of the job, ``Placements.dtensors(source)`` wraps the regions
the rank holds, from a run (``RunResult.regions``) or read from a checkpoint. A parameter
held as regions no DTensor placement describes (uneven cuts, several regions on a rank,
regions that overlap) is refused, named, with its regions, unless only the others are
asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from chronotope.compile.program import Program
from chronotope.compile.rvd import Layout, placement, placement_code
from chronotope.errors import ChronotopeError
from chronotope.graph.mask import Index, Mask
from chronotope.runtime import checkpoint

Regions = Mapping[tuple[str, Index], torch.Tensor]


@dataclass(frozen=True)
class Placed:
    """One parameter as DTensor places it: a mesh of ranks and a placement per axis."""

    shape: tuple[int, ...]  # the whole parameter's
    mesh: tuple[int, ...]  # the mesh's shape
    ranks: tuple[int, ...]  # its ranks, row-major
    placements: tuple[str, ...]  # per mesh axis, as DTensor prints it: "R", "S(0)"


@dataclass(frozen=True)
class Placements:
    """Every parameter's ``Placed``, the region of each that each global rank holds, and
    why each parameter no placement describes is left out (``refused``)."""

    params: dict[str, Placed]
    held: tuple[dict[str, Index], ...]
    refused: dict[str, str]

    def dtensors(self, source: Regions | str | Path, device: torch.device | str | None = None,
                 placed_only: bool = False) -> dict[str, Any]:
        """This rank's parameters as DTensors, from its regions or a checkpoint (read for
        the regions it holds). Every rank of the job calls it: each mesh is made on all.
        A parameter no placement describes is refused, naming it, unless ``placed_only``
        (then only the others come back)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor

        if self.refused and not placed_only:
            names = list(self.refused)
            raise ChronotopeError(f"{self.refused[names[0]]} ({len(names)} parameters so: "
                                  f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                                  "); pass placed_only=True for the others")
        if not dist.is_initialized() or dist.get_world_size() != len(self.held):
            raise ChronotopeError(f"DTensors of a {len(self.held)}-rank program are made on "
                                  f"each rank of a job of {len(self.held)} processes")
        rank = dist.get_rank()
        regions = self.read(source) if isinstance(source, (str, Path)) else source
        device = torch.device(device or ("cuda" if dist.get_backend() == "nccl" else "cpu"))
        meshes: dict[tuple, DeviceMesh] = {}
        out = {}
        for name, placed in self.params.items():  # in one order on every rank
            key = (placed.ranks, placed.mesh)
            if key not in meshes:
                meshes[key] = DeviceMesh(device.type, torch.tensor(placed.ranks)
                                         .reshape(placed.mesh))
            if name not in self.held[rank]:
                continue
            local = regions[(name, self.held[rank][name])].to(device)
            out[name] = DTensor.from_local(
                local, meshes[key], [placement(p) for p in placed.placements],
                run_check=False, shape=torch.Size(placed.shape),
                stride=torch.empty(placed.shape, device="meta").stride())
        return out

    def read(self, path: str | Path) -> dict[tuple[str, Index], torch.Tensor]:
        """This rank's regions of checkpoint ``path`` (written under any plan)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        found = checkpoint.latest(path)
        metadata = checkpoint.read_metadata(found)
        saved = checkpoint.model_tensors(metadata)
        regions = {(name, index): torch.zeros(Mask(index).shape,
                                              dtype=saved[name].properties.dtype)
                   for name, index in self.held[rank].items()}
        checkpoint.load(found, checkpoint.Whole(regions, {}),
                        {n: p.shape for n, p in self.params.items()})
        return regions


def placements(program: Program) -> Placements:
    """Each parameter's placements on the ranks that store it (every replica of a scaled
    plan), and why for each no DTensor placement describes."""
    unit, world = program.ndevices, program.plan.world_size
    held: list[dict[str, Index]] = [{} for _ in range(world)]
    params: dict[str, Placed] = {}
    refused: dict[str, str] = {}
    for name, tensor in program.plan.graph.params.items():
        shape = tuple(tensor.shape)
        pieces = [(rank, region) for rank in range(world)
                  for region in program.stored[rank % unit].get(name, ())]
        layout = Layout.of(pieces, shape) if len({r for r, _ in pieces}) == len(pieces) \
            else None
        if layout is None:
            where = "; ".join(f"rank {r}: {list(m.index)}" for r, m in pieces[:4])
            refused[name] = (
                f"{name} (shape {list(shape)}) is held as regions no DTensor placement "
                f"describes ({where}{' ...' if len(pieces) > 4 else ''}): uneven cuts, "
                "several regions on a rank (a fused projection cut head by head) or "
                "regions that overlap; export a checkpoint for it instead")
            continue
        mesh, places, ranks = layout.placements()
        params[name] = Placed(shape, tuple(mesh), tuple(ranks),
                              tuple(placement_code(p) for p in places))
        for rank, region in pieces:
            held[rank][name] = region.index
    return Placements(params, tuple(held), refused)


def to_dtensors(program: Program, source: Regions | str | Path,
                device: torch.device | str | None = None,
                placed_only: bool = False) -> dict[str, Any]:
    """``placements(program).dtensors(...)``: on every rank of the job, this rank's
    parameters as DTensors, from its regions (``RunResult.regions`` of a run under
    torchrun) or a checkpoint."""
    return placements(program).dtensors(source, device, placed_only)
