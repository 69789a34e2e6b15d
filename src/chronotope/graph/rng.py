"""Random ops any piece can compute its own slice of: a counter-based stream.

torch's generators hand out numbers in call order, so a piece of a dropout (half
the batch, a few heads) cannot draw what the whole op would have drawn there. Here
every element's number is a hash of (seed, step, the op's key, the element's index
along each dim), so a piece draws exactly its slice of the whole op's numbers, on
any device and in any order, as Megatron's tensor-parallel RNG tracker and
philox offsets aim to. Capture rewrites torch's random calls into these functions
(each op gets a key: its position among the step's random calls); the
single-device reference runs the model under ``CounterRandom``, which routes the
same calls, in the same order, to the same functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from chronotope.graph.attention import causal_mask

Region = Sequence[tuple[int, int]] | None  # a piece's box in the whole output, None: whole

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Stream:
    """Which numbers a training step draws: one stream per (seed, step). Out of
    ``training`` (an evaluation) dropout keeps everything, as under ``model.eval()``."""

    seed: int = 0
    step: int = 0
    training: bool = True


def _mul32(x: Any, c: int) -> Any:
    """``x * c`` modulo 2**32 for x < 2**32, without overflowing int64 on the way."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix(x: Any) -> Any:
    """A 32-bit integer hash (lowbias32) of x < 2**32; works on ints and int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _bits(stream: Stream, key: int, shape: Sequence[int], region: Region,
          device: torch.device, salt: int = 0) -> torch.Tensor:
    """32 random bits per element of ``region`` of a tensor of ``shape`` (int64)."""
    h = _mix(stream.seed & _MASK32)
    for part in (stream.step, key, salt):
        h = _mix(h ^ (part & _MASK32))
    bits = torch.full((), h, dtype=torch.int64, device=device)
    box = region if region is not None else [(0, n) for n in shape]
    for lo, hi in box:
        index = torch.arange(lo, hi, dtype=torch.int64, device=device)
        bits = _mix(bits.unsqueeze(-1) ^ index)
    return bits


def uniform(stream: Stream, key: int, shape: Sequence[int], region: Region = None, *,
            dtype: torch.dtype = torch.float32, device: Any = None,
            salt: int = 0) -> torch.Tensor:
    """Numbers in [0, 1) for ``region`` of a ``shape`` tensor (24 random bits each)."""
    bits = _bits(stream, key, shape, region, torch.device(device or "cpu"), salt)
    return ((bits >> 8).to(torch.float32) * 2.0 ** -24).to(dtype)


def normal(stream: Stream, key: int, shape: Sequence[int], region: Region = None, *,
           dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
    """Standard normal numbers (Box-Muller over two uniform streams)."""
    u1 = 1.0 - uniform(stream, key, shape, region, device=device, salt=1)  # in (0, 1]
    u2 = uniform(stream, key, shape, region, device=device, salt=2)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).to(dtype)


# ---- the ops capture rewrites torch's random calls into ------------------------------------


def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False,
            *, key: int, stream: Stream = Stream(), region: Region = None) -> torch.Tensor:
    """``F.dropout``: zero each element with probability ``p``, scale the rest by 1/(1-p)."""
    if not (training and stream.training) or p == 0:
        return input
    keep = uniform(stream, key, input.shape, region, device=input.device) >= p
    scale = keep.to(input.dtype) / (1 - p) if p < 1 else keep.to(input.dtype)
    return input.mul_(scale) if inplace else input * scale


def native_dropout(input: torch.Tensor, p: float, train: bool | None, *, key: int,
                   stream: Stream = Stream(), region: Region = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout`` (the exported form): the output and the kept mask."""
    if not (train and stream.training) or p == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = uniform(stream, key, input.shape, region, device=input.device) >= p
    return input * keep.to(input.dtype) / (1 - p), keep


def rand_like(input: torch.Tensor, *, key: int, stream: Stream = Stream(), region: Region = None,
              dtype: torch.dtype | None = None, **_: Any) -> torch.Tensor:
    return uniform(stream, key, input.shape, region, dtype=dtype or input.dtype,
                   device=input.device)


def randn_like(input: torch.Tensor, *, key: int, stream: Stream = Stream(),
               region: Region = None, dtype: torch.dtype | None = None,
               **_: Any) -> torch.Tensor:
    return normal(stream, key, input.shape, region, dtype=dtype or input.dtype,
                  device=input.device)


def bernoulli(input: torch.Tensor, p: Any = None, *, key: int,
              stream: Stream = Stream(), region: Region = None, **_: Any) -> torch.Tensor:
    """``torch.bernoulli(probs)`` (or ``x.bernoulli(p)``, ``x.bernoulli_(p)``): 1 with each
    element's probability."""
    probs = input if p is None else p.to(input.dtype).expand_as(input) \
        if isinstance(p, torch.Tensor) else torch.full_like(input, p)
    u = uniform(stream, key, input.shape, region, dtype=probs.dtype, device=input.device)
    return (u < probs).to(input.dtype)


# ``x.uniform_(a, b)`` and its kin fill ``x`` with new numbers: these make them as a new
# tensor of ``x``'s shape and dtype (``x`` gives only those), drawn like ``rand_like``.


def fill_uniform(input: torch.Tensor, low: float = 0.0, high: float = 1.0, *, key: int,
                 stream: Stream = Stream(), region: Region = None, **kw: Any) -> torch.Tensor:
    low, high = kw.get("from", low), kw.get("to", high)
    u = uniform(stream, key, input.shape, region, device=input.device)
    return (low + (high - low) * u).to(input.dtype)


def fill_normal(input: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, key: int,
                stream: Stream = Stream(), region: Region = None, **_: Any) -> torch.Tensor:
    return (mean + std * normal(stream, key, input.shape, region,
                                device=input.device)).to(input.dtype)


def fill_exponential(input: torch.Tensor, lambd: float = 1.0, *, key: int,
                     stream: Stream = Stream(), region: Region = None,
                     **_: Any) -> torch.Tensor:
    u = uniform(stream, key, input.shape, region, device=input.device)
    return (-torch.log1p(-u) / lambd).to(input.dtype)


def _sizes(size: Sequence[Any]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        return tuple(size[0])
    return tuple(size)


def rand(*size: Any, key: int, stream: Stream = Stream(), region: Region = None,
         dtype: torch.dtype | None = None, device: Any = None, **_: Any) -> torch.Tensor:
    return uniform(stream, key, _sizes(size), region, dtype=dtype or torch.float32, device=device)


def randn(*size: Any, key: int, stream: Stream = Stream(), region: Region = None,
          dtype: torch.dtype | None = None, device: Any = None, **_: Any) -> torch.Tensor:
    return normal(stream, key, _sizes(size), region, dtype=dtype or torch.float32, device=device)


def attention(query: torch.Tensor, key_: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              *, key: int, stream: Stream = Stream(), region: Region = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with dropout on the attention weights, written
    out so that a piece (some batch rows, heads or queries) drops exactly its slice of
    the weights. ``region`` is the piece's box of the output (its rows of a causal mask);
    keys are always whole."""
    if dropout_p == 0 or not stream.training:
        return F.scaled_dot_product_attention(query, key_, value, attn_mask, 0.0, is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    L, S = query.shape[-2], key_.shape[-2]
    if enable_gqa and key_.dim() >= 3 and key_.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key_.shape[-3]
        key_ = key_.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    scores = query @ key_.transpose(-2, -1) * (scale if scale is not None
                                               else 1 / math.sqrt(query.shape[-1]))
    if is_causal:  # a piece's rows sit at region[-2] of the whole op's
        rows = (0, L) if region is None else (region[-2][0], region[-2][1])
        scores = scores.masked_fill(~causal_mask(rows, S, query.device), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    box = None if region is None else [*region[:-1], (0, S)]
    keep = uniform(stream, key, weights.shape, box, device=query.device) >= dropout_p
    return (weights * keep.to(weights.dtype) / (1 - dropout_p)) @ value


# torch's random calls -> the functions above (fx targets, and the exported aten ops)
REWRITES: dict[Any, Callable[..., Any]] = {
    F.dropout: dropout,
    torch.dropout: dropout,
    torch.ops.aten.native_dropout.default: native_dropout,
    torch.rand_like: rand_like,
    torch.ops.aten.rand_like.default: rand_like,
    torch.randn_like: randn_like,
    torch.ops.aten.randn_like.default: randn_like,
    torch.bernoulli: bernoulli,
    torch.ops.aten.bernoulli.default: bernoulli,
    torch.ops.aten.bernoulli.p: bernoulli,
    torch.ops.aten.uniform.default: fill_uniform,
    torch.ops.aten.normal_functional.default: fill_normal,
    torch.ops.aten.exponential.default: fill_exponential,
    torch.rand: rand,
    torch.randn: randn,
    F.scaled_dot_product_attention: attention,
    torch.ops.aten.scaled_dot_product_attention.default: attention,
}

# In-place draws, by the method (eager code under ``CounterRandom``) and by its name (a
# traced ``call_method``): each fills its tensor with a counter form's new tensor.
FILLS: dict[str, Callable[..., Any]] = {
    "bernoulli_": bernoulli, "uniform_": fill_uniform, "normal_": fill_normal,
    "exponential_": fill_exponential,
}
REWRITES.update(FILLS)
REWRITES.update({getattr(torch.Tensor, name): fn for name, fn in FILLS.items()})
_FILLED = frozenset(getattr(torch.Tensor, name) for name in FILLS)

# The sliceable forms' argument names differ from torch's where the key would clash.
_RENAMED = {attention: {"key": "key_"}}


_DRAWN = frozenset(REWRITES.values())


def rewritable(target: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether this call draws numbers and has a counter-based form. A dropout with
    ``p=0`` or out of training, an attention without dropout, draws nothing: it stays as
    it is (and takes no key, in capture and in ``CounterRandom`` alike)."""
    fn = counter_form(target)
    if fn is None:
        return False
    rate, training = _DRAWS.get(fn, (None, None))
    if rate is not None and not _arg(args, kwargs, *rate):
        return False
    return training is None or bool(_arg(args, kwargs, *training))


def counter_form(target: Any) -> Callable[..., Any] | None:
    """The counter-based form of a torch random call, if it has one."""
    try:
        return REWRITES.get(target)
    except TypeError:  # an unhashable target
        return None


def _arg(args: tuple, kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return kwargs[name] if name in kwargs else args[index] if index < len(args) else default


# Where a call says how much it drops and whether it trains: (position, name, default).
_DRAWS = {
    dropout: ((1, "p", 0.5), (2, "training", True)),
    native_dropout: ((1, "p", 0.0), (2, "train", True)),
    attention: ((4, "dropout_p", 0.0), None),
}


def drawn(fn: Any) -> bool:
    """Whether ``fn`` is one of the counter-based functions above."""
    try:
        return fn in _DRAWN
    except TypeError:
        return False


def rewrite(target: Any, kwargs: dict[str, Any], key: int) -> tuple[Callable[..., Any], dict]:
    """The counter-based form of a random call, and its keyword arguments."""
    fn = REWRITES[target]
    names = _RENAMED.get(fn, {})
    return fn, {**{names.get(k, k): v for k, v in kwargs.items()}, "key": key}


class CounterRandom(TorchFunctionMode):
    """Runs torch's random calls on the counter-based stream, keyed by their order in the
    step: eager code under it draws what a captured graph of it draws, piece by piece.

    A call it does not route that still draws from torch's generator (an
    ``alpha_dropout``, the dropout inside ``F.multi_head_attention_forward``) is listed in
    ``unreplayed``: no plan can draw those numbers again."""

    def __init__(self, stream: Stream = Stream()) -> None:
        super().__init__()
        self.stream = stream
        self.calls = 0
        self.unreplayed: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not rewritable(func, args, kwargs):
            before = torch.random.get_rng_state()
            result = func(*args, **kwargs)
            if not torch.equal(before, torch.random.get_rng_state()):
                self.unreplayed.append(getattr(func, "__name__", repr(func)))
            return result
        fn, kw = rewrite(func, kwargs, self.calls)
        self.calls += 1
        drawn = fn(*args, **kw, stream=self.stream)
        return args[0].copy_(drawn) if func in _FILLED else drawn
