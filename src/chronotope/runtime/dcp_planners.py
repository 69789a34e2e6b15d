"""DCP planners that write and read regions of tensors (``runtime/checkpoint.py``'s pieces).

Apart from ``checkpoint.py`` so that DCP, which loads DTensor, is imported only by a
process that saves or loads.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
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

from chronotope.graph.mask import Index


@dataclass
class Piece:
    """A tensor that is the box at ``offsets`` of a whole tensor of ``size`` named ``fqn``."""

    fqn: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


def piece(fqn: str, size: Sequence[int], box: Index, tensor: torch.Tensor) -> Piece:
    return Piece(fqn, tuple(size), tuple(lo for lo, _ in box), tensor)


class SavePieces(DefaultSavePlanner):
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


class LoadPieces(DefaultLoadPlanner):
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
