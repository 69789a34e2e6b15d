"""Measured memory: the most bytes of tensors made during a step alive at once.

``PeakMemory`` watches every op that runs inside it (a ``TorchDispatchMode``):
each new storage counts from when an op makes it until it is freed. Views and
in-place results reuse a storage their inputs have, so they add nothing.
Parameters and optimizer state made before the step are not counted, which
leaves activations, what autograd saves, gradients and temporaries: the part
of memory a plan's schedule, recompute and co-shard change. It works on any
device (on CUDA, ``torch.cuda.max_memory_allocated`` counts the same and more), and on
fake tensors, where ``graph/autocast.py`` measures what each op makes in passing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakMemory(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, weakref.ref] = {}  # storage (its C address) -> it, weakly
        self._size: dict[int, int] = {}  # its bytes when last seen

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        self._resized()
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage(), given)
        return out

    def _count(self, storage: torch.UntypedStorage, given: set[int]) -> None:
        where, size = storage._cdata, storage.nbytes()
        if size == 0 or where in given or where in self._alive:
            return
        self.live += size
        self.peak = max(self.peak, self.live)
        self._size[where] = size
        self._alive[where] = weakref.ref(storage, lambda _: self._freed(where))

    def _resized(self) -> None:
        """Storage freed or given back in place (ZeRO-3's reshard and refill resize it)
        between two ops: counted from the next op on."""
        for where, ref in list(self._alive.items()):  # (another rank's thread may free one)
            storage = ref()
            if storage is not None and (size := storage.nbytes()) != self._size[where]:
                self.live += size - self._size[where]
                self._size[where] = size
        self.peak = max(self.peak, self.live)

    def _freed(self, where: int) -> None:
        self.live -= self._size.pop(where, 0)
        self._alive.pop(where, None)
