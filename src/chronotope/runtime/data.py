"""Training data: the batches a run reads, in the shape of the example batch it was planned on.

Every rank reads the data itself, in the same order, and its generated code takes the
slices its pieces need. No batch travels between ranks, no rank waits on a reader, and a
run across nodes needs only the data on each node; what it costs is that each rank
loads whole batches (cheap next to a step for token batches; for large images give the
loader workers). The data's randomness (a shuffling ``DataLoader``, augmentation) draws
from its own generators, seeded alike on every rank and apart from what training draws,
so every rank sees the same batches and a resumed run sees the batches the interrupted
one would have: it reads the data again from the start and skips what was consumed.
A fingerprint of each batch is compared across ranks, so data that differs between
ranks is an error, not a silently wrong run.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from chronotope.errors import ChronotopeError
from chronotope.graph.batch import Batch
from chronotope.graph.ir import Graph
from chronotope.workload import Workload

DataSource = str | Callable[[], Iterable[Any]] | Iterable[Any]
"""``path/to/file.py:fn``, a function returning an iterable of batches, or the iterable."""


class DataError(ChronotopeError):
    """A batch that does not fit the plan, or data that runs out or differs between ranks."""


@dataclass(frozen=True)
class BatchLayout:
    """What a batch must look like: the example batch's structure, its tensors' names,
    shapes and dtypes (as the graph's inputs), and its constants."""

    example: Batch  # tensors as meta tensors: the structure travels, not the data
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, workload: Workload, graph: Graph, replicas: int = 1) -> BatchLayout:
        """``replicas``: a scaled plan's graph holds one replica's rows of the batch."""
        batch = Batch.of(workload.inputs, workload.kwargs, workload.targets)
        meta = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"),
                                    (batch.args, batch.kwargs, batch.targets))
        shapes = tuple((t.shape[0] * replicas, *t.shape[1:]) if t.shape else t.shape
                       for t in graph.inputs)
        return cls(Batch(*meta), tuple(t.name for t in graph.inputs), shapes,
                   tuple(t.dtype for t in graph.inputs))

    def form(self) -> str:
        """How a batch is written, for messages."""
        args, kwargs, targets = self.example.args, self.example.kwargs, self.example.targets
        if kwargs and not args and not targets:
            keys = ", ".join(map(repr, kwargs))
            return f"a dict with keys {keys} (the model's keyword arguments)"
        n = len(args) + len(targets)
        parts = f"{len(args)} model input{'s' if len(args) != 1 else ''}" + (
            f" then {len(targets)} target{'s' if len(targets) != 1 else ''}" if targets else "")
        return ("a tensor or " if n == 1 else "") + f"a tuple of {n}: {parts}" + (
            f", with keyword arguments {', '.join(map(repr, kwargs))}" if kwargs else "")

    def tensors(self, batch: Any, index: int) -> dict[str, torch.Tensor]:
        """Batch number ``index`` as the graph's inputs, by name; a clear error where it
        does not fit the plan."""
        arranged = self._arrange(batch, index)
        leaves, spec = pytree.tree_flatten((arranged.args, arranged.kwargs, arranged.targets))
        expected, want = pytree.tree_flatten((self.example.args, self.example.kwargs,
                                              self.example.targets))
        if spec != want:
            raise DataError(f"batch {index} is structured unlike the example batch the plan "
                            f"was made for: expected {self.form()}")
        out: dict[str, torch.Tensor] = {}
        tensors = iter(zip(self.names, self.shapes, self.dtypes))
        for got, example in zip(leaves, expected):
            if not isinstance(example, torch.Tensor):
                if got != example:
                    raise DataError(f"batch {index} has {got!r} where the example batch has "
                                    f"{example!r}: the plan holds it as a constant, so every "
                                    "batch must repeat it")
                continue
            name, shape, dtype = next(tensors)
            if not isinstance(got, torch.Tensor):
                raise DataError(f"batch {index}: input {name!r} is a {type(got).__name__}, "
                                "not a tensor")
            if tuple(got.shape) != shape or got.dtype != dtype:
                raise DataError(
                    f"batch {index}: input {name!r} is {_describe(got.shape, got.dtype)} but "
                    f"the plan was made for {_describe(shape, dtype)}; every batch must have "
                    "the example batch's shape (a DataLoader's last batch is smaller unless "
                    "drop_last=True)")
            out[name] = got.contiguous()  # generated code views inputs as it reshapes them
        return out

    def _arrange(self, batch: Any, index: int) -> Batch:
        example = self.example
        if isinstance(batch, Mapping):
            if example.args or example.targets:
                raise DataError(f"batch {index} is a dict, but the model takes {self.form()}")
            return Batch((), dict(batch), ())
        n = len(example.args)
        if isinstance(batch, torch.Tensor):
            batch = (batch,)
        if not isinstance(batch, (tuple, list)) or len(batch) != n + len(example.targets):
            what = f"a tuple of {len(batch)}" if isinstance(batch, (tuple, list)) else \
                f"a {type(batch).__name__}"
            raise DataError(f"batch {index} is {what}; expected {self.form()}")
        return Batch(tuple(batch[:n]), dict(example.kwargs), tuple(batch[n:]))


def _describe(shape: Any, dtype: torch.dtype) -> str:
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"


def resolve(source: DataSource) -> Callable[[], Iterable[Any]] | Iterable[Any]:
    """The function or iterable a data source names (a file's function, loaded here)."""
    if not isinstance(source, str):
        return source
    from chronotope.models import load_function
    return load_function(source)


class DataRandom:
    """torch's, Python's and numpy's generators as data code sees them: seeded from
    ``seed`` alike on every rank, and kept apart from what training draws."""

    def __init__(self, seed: int) -> None:
        self.torch = torch.Generator().manual_seed(seed).get_state()
        self.python = random.Random(seed).getstate()
        self.numpy = _numpy_state(seed)
        self._saved: tuple | None = None

    def __enter__(self) -> DataRandom:
        self._saved = (torch.get_rng_state(), random.getstate(), _numpy_get())
        torch.set_rng_state(self.torch)
        random.setstate(self.python)
        _numpy_set(self.numpy)
        return self

    def __exit__(self, *exc: object) -> None:
        self.torch, self.python, self.numpy = torch.get_rng_state(), random.getstate(), \
            _numpy_get()
        assert self._saved is not None
        torch.set_rng_state(self._saved[0])
        random.setstate(self._saved[1])
        _numpy_set(self._saved[2])


def _numpy_state(seed: int) -> Any:
    np = sys.modules.get("numpy")
    return np.random.RandomState(seed).get_state() if np is not None else None


def _numpy_get() -> Any:
    np = sys.modules.get("numpy")
    return np.random.get_state() if np is not None else None


def _numpy_set(state: Any) -> None:
    np = sys.modules.get("numpy")
    if np is not None and state is not None:
        np.random.set_state(state)


class Batches:
    """Batch after batch from a data source, passes over it repeated as needed (``once``:
    one pass, as an evaluation reads); ``start`` batches are read and skipped first (a
    resumed run)."""

    def __init__(self, source: DataSource, layout: BatchLayout, seed: int = 0,
                 start: int = 0, once: bool = False) -> None:
        self.label = source if isinstance(source, str) else getattr(
            source, "__qualname__", type(source).__name__)
        self.source = resolve(source)
        self.layout = layout
        self.random = DataRandom(seed)
        self.read = 0  # batches taken so far
        self.passes = 0  # passes over the data begun
        self.in_pass = 0  # batches taken in this pass
        self.once = once
        self._it: Iterator[Any] | None = None
        for _ in range(start):
            self._next_raw()

    def _next_raw(self) -> Any:
        with self.random:
            for _ in range(2):  # this pass, or the next one
                if self._it is None:
                    self._start_pass()
                try:
                    batch = next(self._it)
                except StopIteration:
                    if not self.in_pass:
                        raise DataError(f"the data {self.label} gives no batches") from None
                    if self.once:
                        raise
                    self._it = None
                    continue
                self.in_pass += 1
                self.read += 1
                return batch
        raise AssertionError("unreachable")

    def _start_pass(self) -> None:
        data = self.source() if callable(self.source) else self.source
        it = iter(data)
        if it is data and self.passes and not callable(self.source):
            raise DataError(f"the data {self.label} ran out after {self.read} batches; give a "
                            "function or a re-iterable (a list, a DataLoader) to read it again")
        self._it, self.in_pass = it, 0
        self.passes += 1

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        index = self.read
        return self.layout.tensors(self._next_raw(), index)


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Two numbers per input that differ when the inputs do, samples in another order
    included (ranks take slices of a batch, so its order matters); no copy of the batch."""
    out = []
    for t in tensors.values():
        rows = t.detach().reshape(t.shape[0] if t.ndim else 1, -1)
        sums = torch.sum(rows, dim=1, dtype=torch.float64)
        order = torch.arange(1, len(sums) + 1, dtype=torch.float64, device=sums.device)
        out += [sums.sum(), (sums * order).sum()]
    return torch.stack(out) if out else torch.zeros(1, dtype=torch.float64)


def example_batches(workload: Workload) -> list[Any]:
    """The example batch as the one batch of a data set (each pass reads it again), in the
    form ``BatchLayout`` reads: keyword arguments alone as a dict, else a tuple of the
    model's inputs then its targets."""
    batch = Batch.of(workload.inputs, workload.kwargs, workload.targets)
    if batch.kwargs and not batch.args and not batch.targets:
        return [dict(batch.kwargs)]
    return [(*batch.args, *batch.targets)]
