"""Mixed precision: what a step computes in, what reductions travel in, and fp16 loss scaling.

``Precision("bf16")`` runs every rank's step under ``torch.autocast`` in bfloat16, the
same per-op policy the single-device reference runs under (``train_reference(...,
precision=...)``): parameters stay fp32 master weights, each op casts them as eager
autocast does, and the optimizer and its state see fp32 only. The backward of each
region runs with autocast off, as ``loss.backward()`` after an autocast forward does.

Communication under a low precision (``StepContext``):

- messages, gathers, all-to-alls and broadcasts travel in the wire dtype (``wire_dtype``:
  fp32 for any floating type of 32 bits or fewer), so a receiver always gets the buffer it
  allocated whatever dtype autocast gave the sender, and hands it on in the dtype the
  compiled instruction declares (exact: a bf16 or fp16 value is an fp32 value). A bf16
  activation thus takes twice its bytes on the wire: sending 16 bits needs the compiler
  to know what dtype autocast gives each tensor;
- gradient reductions (all-reduce, reduce-scatter) sum in ``reduce`` (fp32 unless
  ``Precision(..., reduce="bf16")``); other reductions (a row-parallel layer's partial
  sums, a loss's token count) sum in fp32; each rank gets the sum back in the dtype of
  what it gave.

fp16 adds dynamic loss scaling as ``torch.amp.GradScaler`` does it: the loss's gradient
starts at ``scale`` (``rt.seed``), the owned gradients are unscaled before clipping, a
step whose gradients hold an inf or NaN on ANY rank is skipped on every rank (the flag is
all-reduced), and the scale backs off by ``backoff_factor``; after ``growth_interval``
good steps in a row it grows by ``growth_factor``.

Ops without low-precision support (``check_precision``, before anything runs; the CLI
exits with 2 on its ``PrecisionError``). Running every op kind of the registry forward and
backward on bf16 and fp16 CPU tensors under autocast (torch 2.13) fails for two reasons
only:

- a kernel with no 16-bit version: antialiased resampling (``UNSUPPORTED``, per device
  type; CUDA was not measured here and has no entry);
- an op that needs its tensors in one dtype (``index_add``, ``index_put``, ``scatter``,
  ``scatter_add``, ``scatter_reduce``: ``SAME_DTYPE``) handed an fp32 destination and a
  source a lower-precision op (a linear, a matmul) made in bf16: the check infers each
  tensor's dtype under autocast on fake tensors (no compute) and names the op.

What the check cannot see (a user's op that refuses bf16 inside; a kernel missing on
another device) fails when the step runs: a dtype error raised by a piece is reported as
a ``PrecisionError`` naming the piece, its op kind and its source line.
"""

from __future__ import annotations

import ast
import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chronotope.errors import ChronotopeError
from chronotope.graph.autocast import DTYPES, autocast_dtypes

if TYPE_CHECKING:
    from chronotope.graph.ir import Graph, Op
    from chronotope.plan.plan import Plan

ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
           "half": "fp16"}
REDUCE_DTYPES = ("fp32", "bf16")

# Largest relative difference `run --check` accepts from the single-device run under the
# same autocast policy (``compare(...).within(precision.tolerance)``), for its default run
# (3 SGD steps at lr 0.1). Measured with torch 2.13 on CPU, distributed against one
# device, worst of loss / parameters: the built-in GPT under dp=2, tp=2, zero-2, zero-3
# and a 2-stage 1F1B pipeline, bf16 2.2e-5 / 1.5e-4 (tp: a row-parallel linear rounds
# each partial sum to bf16 before they are added), fp16 2.7e-6 / 2.3e-5; dp=2 and tp=2 of
# every built-in model, bf16 3.2e-3 / 6.7e-4 (swin, whose loss falls from 2.3 to 1.4 in
# one step and amplifies rounding), fp16 3.6e-4 / 1.6e-4. For scale: bf16 against fp32 on
# one device is 1.3e-5 / 1.8e-4 for GPT and 1.7e-3 / 2.1e-3 for swin, and a plan that
# drops half of every gradient misses GPT's run by 1.3e-2 / 1.2e-2. The tolerances leave
# 3x (bf16) and 5x (fp16) over the worst model. Longer runs drift apart further (10 SGD
# steps: bf16 up to 1.2e-2 in the loss), and AdamW, which normalizes every update, turns
# rounding of near-zero gradients into parameter differences of up to 1.2e-2 in 10
# steps: check with a few SGD steps, and a plan's partitioning in fp32 (1e-5).
BF16_TOLERANCE = 1e-2
FP16_TOLERANCE = 2e-3
FP32_TOLERANCE = 1e-5  # as `run --check` without --dtype


class PrecisionError(ChronotopeError):
    """An op that cannot run in the low precision asked for (named, with its device)."""


@dataclass(frozen=True)
class Precision:
    """What a training step computes in (``dtype``), what its gradient reductions sum in
    (``reduce``), and fp16's dynamic loss scaling (torch's ``GradScaler`` defaults).

    Picklable: it travels to worker processes with the specs.
    """

    dtype: str = "fp32"  # "bf16", "fp16" or "fp32" (or torch's names: "bfloat16", ...)
    reduce: str = "fp32"  # gradient reductions: "fp32" or "bf16"
    init_scale: float = 2.0 ** 16  # fp16 only
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        for field_name, allowed in (("dtype", tuple(DTYPES)), ("reduce", REDUCE_DTYPES)):
            value = getattr(self, field_name)
            if isinstance(value, torch.dtype):
                value = next((k for k, v in DTYPES.items() if v == value), str(value))
            value = ALIASES.get(str(value).lower().removeprefix("torch."), str(value).lower())
            if value not in allowed:
                raise ValueError(f"unknown {field_name} {getattr(self, field_name)!r}: use "
                                 f"{', '.join(allowed)}")
            object.__setattr__(self, field_name, value)
        if not (self.init_scale > 0 and self.growth_factor >= 1
                and 0 < self.backoff_factor < 1 and self.growth_interval >= 1):
            raise ValueError("loss scaling needs init_scale > 0, growth_factor >= 1, "
                             "0 < backoff_factor < 1 and growth_interval >= 1")

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce]

    @property
    def low(self) -> bool:
        """Computes in a 16-bit type (under autocast)."""
        return self.dtype != "fp32"

    @property
    def plain(self) -> bool:
        """fp32 everywhere: runs exactly as with no precision at all."""
        return self.dtype == "fp32" and self.reduce == "fp32"

    @property
    def scaled(self) -> bool:
        """Uses dynamic loss scaling (fp16: its range is too small for gradients)."""
        return self.dtype == "fp16"

    @property
    def tolerance(self) -> float:
        """What ``run --check`` accepts from the single-device run under the same policy."""
        if self.reduce == "bf16" or self.dtype == "bf16":
            return BF16_TOLERANCE
        return FP16_TOLERANCE if self.dtype == "fp16" else FP32_TOLERANCE

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The forward's autocast (nothing in fp32). No weight-cast cache: a rank enters
        fresh leaves for every piece, so a cache would keep a 16-bit copy of every weight
        use until the step ends; each cast is made again instead, as the same bits."""
        if not self.low:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.compute_dtype, cache_enabled=False)

    def scaler(self) -> LossScale | None:
        return LossScale(self) if self.scaled else None


def plan_precision(plan: Plan) -> Precision | None:
    """The mixed precision a plan was made for (``plan.dtype``), None for fp32."""
    return None if plan.dtype == "fp32" else Precision(plan.dtype)


def tolerance(precision: Precision | None) -> float:
    return FP32_TOLERANCE if precision is None else precision.tolerance


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a floating tensor travels in under a low precision: every sender and receiver
    agrees on it without knowing what autocast gave the other side."""
    if dtype.is_floating_point and dtype.itemsize <= 4:
        return torch.float32
    return dtype


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type, enabled=False)


class LossScale:
    """fp16's dynamic loss scale on one rank, updated as ``torch.amp.GradScaler`` updates
    its own (by the same kernels); every rank keeps the same one, as they update it from
    the same all-reduced flag."""

    def __init__(self, precision: Precision) -> None:
        self.precision = precision
        self._scale = torch.full((), float(precision.init_scale), dtype=torch.float32)
        self._good = torch.zeros((), dtype=torch.int32)  # GradScaler's growth tracker
        self.skipped = 0  # steps skipped so far

    @property
    def scale(self) -> float:
        return float(self._scale)

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale.fill_(value)

    @property
    def good(self) -> int:
        """Steps without an inf or NaN since the scale last changed."""
        return int(self._good)

    @good.setter
    def good(self, value: int) -> None:
        self._good.fill_(value)

    def unscale_(self, grads: Sequence[torch.Tensor], factor: float = 1.0,
                 device: torch.device | str = "cpu") -> torch.Tensor:
        """Multiply ``grads`` by ``factor / scale`` in place; 1.0 (a float32 tensor on
        ``device``) where one of them holds an inf or NaN, else 0.0."""
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), factor / self.scale, dtype=torch.float32, device=device)
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), group in by_device.items():
            flag = found if dev == found.device else torch.zeros_like(found, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv.to(dev))
            if flag is not found:
                found += flag.to(found.device)
        return found

    def update(self, found_inf: bool) -> bool:
        """The next scale after a step (GradScaler's update); True when the step is to be
        taken."""
        p = self.precision
        torch._amp_update_scale_(self._scale, self._good,
                                 torch.full((), float(found_inf), dtype=torch.float32),
                                 p.growth_factor, p.backoff_factor, p.growth_interval)
        self.skipped += int(found_inf)
        return not found_inf


# ---- ops that cannot run in a low precision -----------------------------------------------

def _antialiased(op: Op) -> bool:
    name = op.target if isinstance(op.target, str) else getattr(op.target, "__name__", "")
    return str(name).endswith("_aa") or op.kwargs.get("antialias") is True or (
        len(op.args) > 6 and op.args[6] is True)  # F.interpolate's antialias, by position


# (device type, op kind, which calls of it, why): kernels with no bf16/fp16 version
# (torch 2.13, measured on CPU).
UNSUPPORTED: tuple[tuple[str, str, Callable[[Op], bool], str], ...] = (
    ("cpu", "interpolate", _antialiased,
     "antialiased resampling has no bfloat16/float16 kernel on CPU"),
)
# Ops whose kernel refuses tensors of mixed floating dtypes (destination and source):
# under autocast a source made by a lower-precision op (a linear, a matmul) meets an fp32
# destination.
SAME_DTYPE = frozenset({"index_add", "index_put", "scatter", "scatter_add", "scatter_reduce"})


def _unsupported(op: Op, device_type: str) -> str | None:
    return next((why for device, kind, calls, why in UNSUPPORTED
                 if device == device_type and op.kind == kind and calls(op)), None)


def _where(op: Op) -> str:
    return f"op {op.name} ({op.kind}{', ' + str(op.source) if op.source else ''})"


def check_precision(graph: Graph, precision: Precision | None,
                    device_type: str = "cpu") -> None:
    """Refuse, before anything runs, a graph with an op that cannot run under
    ``precision``'s autocast on ``device_type``; the error names the op and why."""
    if precision is None or not precision.low:
        return
    name = precision.dtype
    for op in graph.ops:
        why = _unsupported(op, device_type)
        if why:
            raise PrecisionError(f"{_where(op)} cannot run in {name} on {device_type}: {why}; "
                                 "train in fp32 or rewrite the op")
    inferred = autocast_dtypes(graph, precision.dtype)
    for op in graph.ops:
        if op.kind in SAME_DTYPE:
            dtypes = [inferred.get(t, t.dtype) for t in op.inputs]
            floats = sorted({str(d).removeprefix("torch.") for d in dtypes
                             if d is not None and d.is_floating_point})
            if len(floats) > 1:
                raise PrecisionError(
                    f"{_where(op)} cannot run in {name}: under autocast its tensors come as "
                    f"{' and '.join(floats)}, and {op.kind} needs one dtype; cast the source "
                    "to the destination's dtype in the model (or train in fp32)")


# ---- a dtype error raised while a rank's step ran ----------------------------------------

_DTYPE_ERROR = re.compile(r"BFloat16|Half|dtype|scalar type", re.IGNORECASE)
_PIECE = re.compile(r"^\s*# (\S+): (\S+)(?:, recomputed in backward)?\s*(?:\((.*)\))?\s*$")
_PIECES = re.compile(r"rt\.backward\(.*\((\s*'[^)]*)\)\)")


def _statement(code: str, line: int) -> str:
    """The innermost statement of ``code`` that spans ``line``, on one line (the generated
    code cuts long calls over several)."""
    found = None
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or line):
            if found is None or node.lineno >= found.lineno:
                found = node
    text = ast.get_source_segment(code, found) if found is not None else None
    return " ".join((text or code.splitlines()[line - 1]).split())


def step_error(error: BaseException, code: str, filename: str, rank: int,
               precision: Precision, device_type: str) -> PrecisionError | None:
    """A ``PrecisionError`` naming the op whose piece raised ``error`` (a dtype error in
    the generated step ``code``), or None when it is some other error."""
    if not isinstance(error, (RuntimeError, NotImplementedError, TypeError)) \
            or not _DTYPE_ERROR.search(str(error)):
        return None
    line = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    lines = code.splitlines()
    what = "an op"
    if line is not None and 0 < line <= len(lines):
        called = _PIECES.search(_statement(code, line))
        if called:
            what = f"the backward of {called.group(1).strip()}"
        else:
            for text in reversed(lines[:line]):
                found = _PIECE.match(text)
                if found:
                    piece, kind, source = found.groups()
                    what = f"{kind} piece {piece}" + (f" ({source})" if source else "")
                    break
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return PrecisionError(f"rank {rank}: {what} cannot run in {precision.dtype} on "
                          f"{device_type}: {message}; train in fp32 or rewrite the op")

