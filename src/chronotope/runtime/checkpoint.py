"""Checkpoints on ``torch.distributed.checkpoint`` (DCP), resharded on load.

Each rank writes the regions of parameters it stores and the optimizer state of the
regions it updates, as chunks of the whole tensors at their offsets: the layouts give
every chunk's place, so a checkpoint written under one plan loads under any other
(another policy, another device count) and DCP reads each rank exactly the pieces it
needs. Every element is written once: a region several ranks hold (replicas) by the
lowest of them. Tensors are named as ``torch.distributed.checkpoint.state_dict``
names them (``model.<param>``, ``optim.state.<param>.<state>``); the run's position
and what the checkpoint is of travel as one more entry (``chronotope``).

A checkpoint is written into ``step-<n>.incomplete`` and renamed to ``step-<n>`` once
every rank has finished, and ``latest`` then names it: a run killed while saving leaves
the previous checkpoint as it was, and the partial one says what it is.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import re
import shutil
import socket
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from chronotope.errors import ChronotopeError
from chronotope.graph.mask import Index, Mask

MODEL = "model."
OPTIM = "optim.state."
GROUPS = "optim.param_groups."  # the optimizer's groups, as one device has them
# Checkpoints others write (torch's get_state_dict, FSDP2, torchtitan): the model under
# "model." or (a weights-only export) at the top, the optimizer's state under "optim.state."
# or "optimizer.state.", and torchtitan's step in "train_state.step".
OPTIMS = (OPTIM, "optimizer.state.")
NOT_MODEL = ("optim.", "optimizer.", "lr_scheduler.", "lr_schedulers.", "dataloader.",
             "train_state.", "chronotope")
STEP = "train_state.step"
STATE = "chronotope"  # the run's position and what the checkpoint is of
FORMAT = 1
INCOMPLETE = ".incomplete"
LATEST = "latest"
LEASE = ".lease"  # the run saving into a folder: {"host", "pid"}
CHECKSUMS = "checksums"  # of one rank's files: {name: [bytes, crc32]}
SHARED = ".shared-"  # rank 0's marker that every rank sees the folder (``check_shared``)


class CheckpointError(ChronotopeError):
    """A checkpoint that is missing, incomplete, or of another model."""


# ---- who writes what ---------------------------------------------------------------------


def writers(held: Sequence[Mapping[str, Sequence[Index]]]) -> list[dict[str, list[Index]]]:
    """For each rank, the boxes of each tensor it writes, given the boxes each rank holds:
    every element of what the ranks hold once, by the holder with the least to write so
    far (replicas share the writing).

    The boxes are cut at every boundary any rank's box has, so regions that overlap
    without being equal (one rank holds a row, another a column) are written once too.
    """
    out: list[dict[str, list[Index]]] = [{} for _ in held]
    load = [0] * len(held)
    for name in sorted({n for h in held for n in h}):
        boxes = [(r, tuple(b)) for r, h in enumerate(held) for b in h.get(name, ())]
        ndim = len(boxes[0][1])
        cuts = [sorted({x for _, b in boxes for x in b[d]}) for d in range(ndim)]
        for cell in itertools.product(*(zip(c, c[1:]) for c in cuts)):
            holders = {r for r, b in boxes
                       if all(lo <= c0 and c1 <= hi for (c0, c1), (lo, hi) in zip(cell, b))}
            if holders:
                writer = min(holders, key=lambda r: (load[r], r))
                load[writer] += math.prod(c1 - c0 for c0, c1 in cell)
                out[writer].setdefault(name, []).append(tuple(cell))
    return out


def _within(boxes: Mapping[tuple[str, Index], torch.Tensor], name: str, box: Index
            ) -> tuple[tuple[str, Index], torch.Tensor]:
    """The held region of ``name`` containing ``box``, and ``box``'s part of it."""
    want = Mask(box)
    for (held_name, index), t in boxes.items():
        if held_name == name and Mask(index).contains(want):
            return (held_name, index), t[want.local_slices(Mask(index))]
    raise ValueError(f"no held region of {name} contains {list(box)}")


# ---- DCP planners over regions -----------------------------------------------------------


@dataclass
class Piece:
    """A tensor that is the box at ``offsets`` of a whole tensor of ``size`` named ``fqn``."""

    fqn: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


def _piece(fqn: str, size: Sequence[int], box: Index, tensor: torch.Tensor) -> Piece:
    return Piece(fqn, tuple(size), tuple(lo for lo, _ in box), tensor)


class _SavePieces(DefaultSavePlanner):
    """Writes the given pieces, each a chunk at its offsets, and objects as bytes."""

    def __init__(self, pieces: Sequence[Piece], objects: Mapping[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {(p.fqn, p.offsets): p for p in pieces}
        self.objects = dict(objects)

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(p.fqn, torch.Size(p.offsets)),
                           type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(torch.Size(p.offsets), p.tensor.shape),
                               properties=TensorProperties.create_from_tensor(p.tensor),
                               size=torch.Size(p.size)))
                 for p in self.pieces.values()]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
                  for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.offset is None:
            return self.objects[index.fqn]
        return self.pieces[(index.fqn, tuple(index.offset))].tensor


class _LoadPieces(DefaultLoadPlanner):
    """Reads into the given pieces whatever chunks of the checkpoint overlap them."""

    def __init__(self, pieces: Sequence[Piece], objects: Sequence[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {(p.fqn, p.offsets): p for p in pieces}
        self.wanted = list(objects)
        self.objects: dict[str, Any] = {}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for p in self.pieces.values():
            md = self.metadata.state_dict_metadata[p.fqn]
            chunk = ChunkStorageMetadata(torch.Size(p.offsets), p.tensor.shape)
            items += create_read_items_for_chunk_list(p.fqn, md, [chunk])
        items += [ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                           dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                           storage_offsets=torch.Size((0,)), lengths=torch.Size((0,)))
                  for key in self.wanted]
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[(index.fqn, tuple(index.offset))].tensor


# ---- where checkpoints are ---------------------------------------------------------------


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def latest(directory: str | os.PathLike, verify: bool = True) -> Path:
    """The complete checkpoint ``directory`` is, or the newest one in it; ``verify``: whose
    files are all there as they were written (a damaged one is named by its file, and the
    newest sound one before it used, said so)."""
    root = Path(directory)
    if (root / ".metadata").is_file():
        if verify and (damage := damaged(root)):
            raise CheckpointError(damage)
        return root
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint at {str(root)!r}: no such folder")
    complete = [p for p in root.glob("step-*") if re.fullmatch(r"step-\d+", p.name)
                and (p / ".metadata").is_file()]
    pointer = root / LATEST  # the one saved last (a run resumed from an earlier step)
    named = root / pointer.read_text().strip() if pointer.is_file() else None
    first = None
    for path in sorted(complete, key=lambda p: (p == named, int(p.name[5:])), reverse=True):
        damage = damaged(path) if verify else None
        if damage is None:
            if first is not None:
                warnings.warn(f"{first}: continuing from {str(path)!r} instead", stacklevel=2)
            return path
        first = first or damage
    if first is not None:
        raise CheckpointError(first)
    partial = sorted(p.name for p in root.glob(f"step-*{INCOMPLETE}"))
    raise CheckpointError(
        f"no complete checkpoint in {str(root)!r}" +
        (f" (incomplete, from a run stopped while saving: {', '.join(partial)})" if partial
         else ""))


def damaged(path: Path) -> str | None:
    """What is wrong with checkpoint ``path``'s files (None: nothing): one missing, or
    not the size or checksum it had when it was written."""
    try:
        read_metadata(path)
    except CheckpointError as e:
        return str(e)
    for sums in sorted(path.glob(f"{CHECKSUMS}*")):
        for name, (size, crc) in json.loads(sums.read_text()).items():
            f = path / name
            if not f.is_file():
                return f"checkpoint {str(path)!r} is missing {name}: it cannot be read"
            if f.stat().st_size != size or _crc(f) != crc:
                return (f"checkpoint {str(path)!r} is damaged: {name} is not as it was "
                        f"written ({f.stat().st_size} bytes, {size} when saved)")
    return None


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_metadata(path: Path) -> Metadata:
    """The checkpoint's metadata, once every file it names is there."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated or overwritten file: unpickling fails any way
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: its .metadata cannot be "
                              f"read ({type(e).__name__}: {e})") from e
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} is missing {', '.join(missing)} "
                              f"(of {len(files)} files): it cannot be read")
    return metadata


def model_prefix(metadata: Metadata) -> str:
    """What the model's tensors are named under: ``model.``, or nothing (a weights-only
    export)."""
    return MODEL if any(k.startswith(MODEL) for k in metadata.state_dict_metadata) else ""


def model_tensors(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """The model's tensors a checkpoint holds, by their names in the model."""
    prefix = model_prefix(metadata)
    return {k[len(prefix):]: md for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) and k.startswith(prefix)
            and (prefix or not k.startswith(NOT_MODEL))}


def check_fits(path: Path, shapes: Mapping[str, tuple[int, ...]],
               names: Sequence[str] = ()) -> Metadata:
    """The metadata of checkpoint ``path``, which must hold exactly these parameters
    (``names``: every name of the model's state dict, tied weights' and buffers' too)."""
    metadata = read_metadata(path)
    saved = model_tensors(metadata)
    for name, shape in shapes.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {str(path)!r} is of another model: it has no "
                                  f"parameter {name!r}")
        if tuple(saved[name].size) != tuple(shape):
            raise CheckpointError(f"checkpoint {str(path)!r} is of another model: parameter "
                                  f"{name!r} is {tuple(saved[name].size)} there, "
                                  f"{tuple(shape)} here")
    info = run_info(path, metadata)
    extra = sorted(set(saved) - set(shapes) - set(names) - set(info.get("buffers", ()))
                   - set(info.get("state_dict", ())))
    if extra:
        raise CheckpointError(f"checkpoint {str(path)!r} is of another model: it has "
                              f"parameters this one lacks: {', '.join(extra[:5])}"
                              + (" ..." if len(extra) > 5 else ""))
    return metadata


def run_info(path: Path, metadata: Metadata | None = None) -> dict[str, Any]:
    """The ``chronotope`` entry: the run's position and what the checkpoint is of."""
    metadata = metadata or read_metadata(path)
    if not isinstance(metadata.state_dict_metadata.get(STATE), BytesStorageMetadata):
        return _others_info(path, metadata)
    planner = _LoadPieces([], [STATE])
    with _one_process():
        dcp.load({}, storage_reader=dcp.FileSystemReader(str(path)), planner=planner,
                 no_dist=True)
    return planner.objects[STATE]


def _others_info(path: Path, metadata: Metadata) -> dict[str, Any]:
    """What a checkpoint another program wrote says of itself: its model's tensor names,
    and its step where it records one (torchtitan's ``train_state.step``; else 0)."""
    step, md = 0, metadata.state_dict_metadata.get(STEP)
    if isinstance(md, TensorStorageMetadata):
        t = torch.zeros((), dtype=md.properties.dtype)
        with _one_process():
            dcp.load({}, storage_reader=dcp.FileSystemReader(str(path)),
                     planner=_LoadPieces([Piece(STEP, (), (), t)], []), no_dist=True)
        step = int(t)
    names = list(model_tensors(metadata))
    return {"format": None, "model": None, "step": step, "batches": step,
            "state_dict": {n: n for n in names}, "buffers": [], "optimizer": None}


# ---- save and load one rank --------------------------------------------------------------


@dataclass
class Writes:
    """What one rank writes: boxes of the parameters it stores and of the optimizer state
    of the regions it updates, whether it writes the buffers and the run's entry."""

    params: dict[str, list[Index]]
    optim: dict[str, list[Index]]
    lead: bool  # the lowest rank: buffers (every rank holds them whole) and the run's entry


def plan_writes(program: Any) -> list[Writes]:
    """Each global rank's ``Writes`` from a program's stored regions (the first replica of
    a scaled plan writes them; the others hold the same) and the regions each updates
    (replicas that share the optimizer state out each write theirs)."""
    stored, world = program.stored, program.ndevices * program.plan.replicas
    params = writers([{n: [m.index for m in ms] for n, ms in s.items()} for s in stored])
    updated: list[dict[str, list[Index]]] = [{} for _ in range(world)]
    for rank in range(world):
        for name, index in program.updated(rank):
            updated[rank].setdefault(name, []).append(index)
    optim = writers(updated)
    return [Writes(params[rank] if rank < len(params) else {}, optim[rank], rank == 0)
            for rank in range(world)]


def save(directory: str | os.PathLike, step: int, rank: Any, writes: Writes,
         shapes: Mapping[str, tuple[int, ...]], info: Mapping[str, Any]) -> Path:
    """Every rank calls this at the same step: rank ``rank`` writes its part of checkpoint
    ``step``; returns the complete checkpoint's folder."""
    final = step_dir(directory, step)
    partial = final.with_name(final.name + INCOMPLETE)
    if writes.lead:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    # Views, not copies: DCP copies a view that is not its whole storage, as it writes it.
    # each tensor under every name the module has for it (a tied weight's too), as
    # torch.distributed.checkpoint.state_dict names them
    names = info.get("state_dict", {})
    aliases = {name: [a for a, saved in names.items() if saved == name and a != name]
               for name in writes.params}
    pieces = [_piece(MODEL + fqn, shapes[name], box,
                     _within(rank.stored, name, box)[1].detach())
              for name, boxes in writes.params.items() for box in boxes
              for fqn in (name, *aliases[name])]
    for name, boxes in writes.optim.items():
        for box in boxes:
            key, region = _within(rank.params, name, box)
            param = rank.params[key]
            for k, v in (rank.optimizer.state.get(param, {}) if rank.optimizer else {}).items():
                if not isinstance(v, torch.Tensor):
                    continue
                if v.shape == param.shape:
                    local = Mask(box).local_slices(Mask(key[1]))
                    pieces.append(_piece(f"{OPTIM}{name}.{k}", shapes[name], box,
                                         v[local].detach()))
                elif (v.ndim == 0 or tuple(param.shape) == tuple(shapes[name])) and \
                        all(lo == 0 for lo, _ in box):  # a step count, or the state of a
                    # whole parameter shaped otherwise (Adafactor's factors): once, whole
                    pieces.append(Piece(f"{OPTIM}{name}.{k}", tuple(v.shape), (0,) * v.ndim,
                                        v.detach()))
    objects: dict[str, Any] = {}
    if writes.lead:
        pieces += [Piece(MODEL + name, tuple(t.shape), (0,) * t.ndim, t.detach())
                   for name, t in rank.state.items() if name in info.get("buffers", ())]
        objects[STATE] = dict(info)
        objects.update({f"{GROUPS}{g}.{key}": value
                        for g, group in enumerate(info.get("param_groups", ()))
                        for key, value in group.items()})
    dcp.save({}, storage_writer=dcp.FileSystemWriter(str(partial)),
             planner=_SavePieces(pieces, objects), no_dist=not dist.is_initialized())
    # each rank's checksums of the files it wrote (the lead's with the metadata), so that a
    # damaged file is found before a resume reads it
    me = dist.get_rank() if dist.is_initialized() else 0
    mine = [*partial.glob(f"__{me}_*"), *([partial / ".metadata"] if writes.lead else [])]
    (partial / f"{CHECKSUMS}-{me}").write_text(json.dumps(
        {f.name: [f.stat().st_size, _crc(f)] for f in mine if f.is_file()}))
    _barrier()
    if writes.lead:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        pointer = Path(directory) / (LATEST + ".tmp")
        pointer.write_text(final.name + "\n")
        os.replace(pointer, Path(directory) / LATEST)
    _barrier()
    return final


@dataclass
class Whole:
    """What ``save`` and ``load`` read of a rank, for a process holding only regions of
    weights (no optimizer): ``stored`` by (name, index), buffers by name."""

    stored: dict[tuple[str, Index], torch.Tensor]
    state: dict[str, torch.Tensor]
    params: dict = field(default_factory=dict)
    optimizer: None = None


def save_whole(directory: str | os.PathLike, params: Mapping[str, torch.Tensor],
               buffers: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> Path:
    """A checkpoint of whole tensors written by this one process (a saved program's
    starting weights): the same layout as a run's, so ``load`` reads it under any plan."""
    boxes = {n: tuple((0, s) for s in t.shape) for n, t in params.items()}
    whole = Whole({(n, boxes[n]): t for n, t in params.items()}, dict(buffers))
    with _one_process():
        return save(directory, 0, whole, Writes({n: [b] for n, b in boxes.items()}, {}, True),
                    {n: tuple(t.shape) for n, t in params.items()}, info)


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints of ``directory``; the ones
    removed."""
    complete = sorted(p for p in Path(directory).glob("step-*")
                      if re.fullmatch(r"step-\d+", p.name) and (p / ".metadata").is_file())
    old = complete[:-keep] if keep > 0 else []
    for path in old:
        shutil.rmtree(path)
    return old


@contextlib.contextmanager
def lease(directory: str | os.PathLike) -> Iterator[None]:
    """One run at a time saves into ``directory`` (made if missing, and so found writable
    before any work): a run that finds another's lease is refused, naming its host and
    pid, unless that run is gone (same host, no such process): then it takes it over and
    says so."""
    root = Path(directory)
    path = root / LEASE
    mine = {"host": socket.gethostname(), "pid": os.getpid()}
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                break
            except FileExistsError:
                holder = _holder(path)
                if holder is None or holder["host"] != mine["host"] or _alive(holder["pid"]):
                    who = "another run" if holder is None else \
                        f"a run on {holder['host']} (pid {holder['pid']})"
                    raise CheckpointError(
                        f"{str(root)!r} is in use by {who}: wait for it, save into another "
                        f"folder, or delete {str(path)!r} if that run is gone") from None
                warnings.warn(f"{str(root)!r} was held by a run that is gone (pid "
                              f"{holder['pid']}): taken over", stacklevel=3)
                path.unlink(missing_ok=True)
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
    except OSError as e:
        raise CheckpointError(f"cannot save checkpoints into {str(root)!r}: "
                              f"{e.strerror or e} ({e.filename or root})") from e
    try:
        yield
    finally:
        if _holder(path) == mine:
            path.unlink(missing_ok=True)


def check_shared(directory: str | os.PathLike) -> None:
    """Every rank sees the folder checkpoints go into: all ranks write into one folder, so
    it must be on storage every node mounts, or a checkpoint splits silently between them.
    Rank 0 leaves a marker there and every rank looks for it; a rank that cannot see it is
    named, with its host, before any step runs."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    root = Path(directory)
    name = [f"{SHARED}{socket.gethostname()}-{os.getpid()}" if dist.get_rank() == 0 else ""]
    if dist.get_rank() == 0:
        (root / name[0]).write_text("rank 0 writes checkpoints here\n")
    dist.broadcast_object_list(name, src=0)
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, ((root / name[0]).is_file(), socket.gethostname()))
    if dist.get_rank() == 0:
        (root / name[0]).unlink(missing_ok=True)
    blind = [(rank, host) for rank, (found, host) in enumerate(seen) if not found]
    if blind:
        raise CheckpointError(
            f"--save {str(root)!r} is not on storage every node sees: rank {blind[0][0]} on "
            f"{blind[0][1]} (and {len(blind) - 1} more) does not find what rank 0 on "
            f"{seen[0][1]} wrote there. Save onto a shared file system (NFS, Lustre, a "
            "mounted bucket) that every node mounts at the same path")


def _holder(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
        return {"host": str(holder["host"]), "pid": int(holder["pid"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def load(path: Path, rank: Any, shapes: Mapping[str, tuple[int, ...]],
         optimizer: str | None = None) -> dict[str, Any]:
    """Fill rank ``rank``'s stored regions, buffers and (when the checkpoint's optimizer is
    ``optimizer``) optimizer state from checkpoint ``path``, written under any plan;
    returns the run's entry."""
    metadata = read_metadata(path)
    saved = metadata.state_dict_metadata
    model = model_prefix(metadata)
    optim = next((o for o in OPTIMS if any(k.startswith(o) for k in saved)), OPTIM)
    pieces = [_piece(model + name, shapes[name], index, t) for (name, index), t in
              rank.stored.items()]
    pieces += [Piece(model + name, tuple(t.shape), (0,) * t.ndim, t)
               for name, t in rank.state.items() if model + name in saved]
    optim_state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    for (name, index), param in rank.params.items():
        prefix = f"{optim}{name}."
        for key, md in saved.items():
            if not key.startswith(prefix) or not isinstance(md, TensorStorageMetadata):
                continue
            if tuple(md.size) == tuple(shapes[name]):
                t = torch.zeros(param.shape, dtype=md.properties.dtype, device=param.device)
                pieces.append(_piece(key, shapes[name], index, t))
            else:
                t = torch.zeros(md.size, dtype=md.properties.dtype)
                pieces.append(Piece(key, tuple(md.size), (0,) * len(md.size), t))
            optim_state.setdefault(param, {})[key.removeprefix(prefix)] = t
    # Several of this rank's pieces may be one tensor's same box (a region it stores and
    # updates): read each once, then copy.
    unique: dict[tuple[str, tuple], Piece] = {}
    copies: list[tuple[Piece, Piece]] = []
    for p in pieces:
        key = (p.fqn, p.offsets)
        if key in unique:
            copies.append((unique[key], p))
        else:
            unique[key] = p
    ours = isinstance(saved.get(STATE), BytesStorageMetadata)
    planner = _LoadPieces(list(unique.values()), [STATE] if ours else [])
    dcp.load({}, storage_reader=dcp.FileSystemReader(str(path)), planner=planner,
             no_dist=not dist.is_initialized())
    for src, dst in copies:
        dst.tensor.copy_(src.tensor)
    info = planner.objects[STATE] if ours else _others_info(path, metadata)
    # another optimizer's state means nothing; another program's is taken where it names
    # the same states
    if rank.optimizer and (info.get("optimizer") == optimizer or not ours):
        for param, state in optim_state.items():
            rank.optimizer.state[param] = state
    return info


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """Reading or writing a checkpoint in one process, as meant (DCP warns that it assumes
    so)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (load|save) in a "
                                                  "single")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- one state dict out of a checkpoint --------------------------------------------------


def consolidate(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's state dict from a checkpoint: every name the module has (tied weights
    under each), persistent buffers included; loads with ``load_state_dict(strict=True)``."""
    path = latest(path)
    metadata = read_metadata(path)
    info = run_info(path, metadata)
    prefix = model_prefix(metadata)
    whole = {prefix + k: torch.empty(md.size, dtype=md.properties.dtype)
             for k, md in model_tensors(metadata).items()}
    with _one_process():
        dcp.load(whole, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return {name: whole[prefix + canonical].clone()
            for name, canonical in info["state_dict"].items()}


def export(path: str | os.PathLike, out: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Write ``consolidate(path)`` to ``out``: ``.safetensors`` or a ``torch.save`` file."""
    state = consolidate(path)
    out = Path(out)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, str(out),
                  metadata={"format": "pt"})
    else:
        torch.save(state, out)
    return state


def hugging_face(model: nn.Module) -> dict[str, Any] | None:
    """A transformers model's class and config, for a checkpoint to be written back as a
    folder ``from_pretrained`` loads; None for any other model."""
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    if not (hasattr(model, "save_pretrained") and callable(to_dict)):
        return None
    return {"class": type(model).__name__, "config": to_dict()}


def export_hugging_face(path: str | os.PathLike, out: str | os.PathLike,
                        max_shard_size: str = "5GB") -> dict[str, torch.Tensor]:
    """Write checkpoint ``path`` of a transformers model as a folder its
    ``from_pretrained`` loads: ``config.json`` and the weights in safetensors shards of at
    most ``max_shard_size`` (with their index when there are several)."""
    import transformers

    path = latest(path)
    described = run_info(path).get("hugging_face")
    if described is None:
        raise CheckpointError(f"{str(path)!r} is not of a Hugging Face transformers model: "
                              "export a state dict (OUT.safetensors or OUT.pt) instead")
    state = consolidate(path)
    config = transformers.AutoConfig.for_model(**described["config"])
    config.architectures = [described["class"]]
    with torch.device("meta"):
        model = getattr(transformers, described["class"])(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    Path(out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size=max_shard_size)
    return state


def state_dict_names(model: nn.Module, params: Sequence[str]) -> dict[str, str]:
    """Each name in ``model.state_dict()``, mapped to the name its tensor is saved under
    (a tied weight to the one name the graph keeps)."""
    by_id = {id(p): n for n, p in model.named_parameters() if n in params}
    names: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names[name] = by_id.get(id(t), name)
    return names



# ---- starting from existing weights ------------------------------------------------------


def load_weights(model: nn.Module, source: str | os.PathLike) -> None:
    """Start ``model`` from existing weights: a state-dict file (``.pt``, ``.bin``,
    ``.safetensors``), a Hugging Face ``save_pretrained`` folder, or a chronotope
    checkpoint. Every tensor must fit; a tied weight may be saved under one of its names."""
    path = Path(source)
    state = read_weights(path)
    own = model.state_dict(keep_vars=True)
    present = {id(own[k]) for k in state if k in own}
    missing = [k for k in own if k not in state and id(own[k]) not in present]
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None)
               or ()]
    unexpected = [k for k in state if k not in own and not any(p.search(k) for p in ignored)]
    wrong = [f"{k} is {tuple(state[k].shape)} there, {tuple(own[k].shape)} here"
             for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
    for what, names in (("lack", missing), ("have tensors the model lacks", unexpected),
                        ("do not fit", wrong)):
        if names:
            verb = f"lack {', '.join(names[:5])}" if what == "lack" else \
                f"{what}: {', '.join(names[:5])}"
            raise CheckpointError(f"the weights in {str(path)!r} {verb}"
                                  + (f" (and {len(names) - 5} more)" if len(names) > 5 else ""))
    if any(t.is_meta for t in own.values()):
        raise CheckpointError(f"cannot load {str(path)!r} into a model on the meta device; "
                              "build it on a real device")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():
        if (path / ".metadata").is_file() or (path / LATEST).is_file() or \
                any(path.glob("step-*")):
            return consolidate(path)
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (path / index).is_file():
                files = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
                return {k: v for f in files for k, v in read_weights(path / f).items()}
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                return read_weights(path / name)
        raise CheckpointError(f"no weights in folder {str(path)!r}: expected model.safetensors, "
                              "pytorch_model.bin (Hugging Face) or a chronotope checkpoint")
    if not path.is_file():
        raise CheckpointError(f"no weights at {str(path)!r}: no such file or folder")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read weights from {str(path)!r}: {e}") from e
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor)
                                                 for v in state.values()):
        raise CheckpointError(f"{str(path)!r} does not hold a state dict (name -> tensor)")
    return dict(state)
