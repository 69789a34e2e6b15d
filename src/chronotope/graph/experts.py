"""Routed experts as one op: each token through the experts its router picked, weighted.

A Mixture-of-Experts layer's experts compute ``y_t = sum_j w_tj * FFN_{e_tj}(x_t)`` for
the ``k`` experts ``e_tj`` a router picked for token ``t``, with weights ``w_tj``.
Written out (a sort of every token by expert, a gather, a grouped matmul over runs of
rows, a scatter back) no piece of it can run on some tokens alone. As one op,
``routed_experts``, its signature says what splits (``graph/ops/moe.py``): the tokens,
each token's output its own (data, sequence and pipeline parallelism cut the layer as
any other per-token op, each piece routing its own tokens), the experts, whose pieces
add what their experts make of the tokens routed to them (expert parallelism: a piece
is given its first expert's index, ``first``), and the experts' hidden features
(tensor parallelism inside them), both sums. No token is dropped.

Hugging Face's experts modules (``@use_experts_implementation``: Mixtral, Qwen2-MoE,
DeepSeek, OLMoE and most MoE models of transformers) are captured as this op through
transformers' own experts interface (``hugging_face_experts``), where their layout
allows it: gate and up projections side by side, not transposed, no biases. The one
weight of gate and up is read as its two halves, so that tensor parallelism gives each
device its part of both (``graph/axes.py``'s ``feeders``: the halves are cut with the op).

Switch Transformers keeps one module per expert and drops the tokens an expert has no
room for (its config's ``expert_capacity``, counted along each sequence by its router):
its experts are captured as this op too, on its experts' weights stacked, a dropped token
routed to no expert (index -1), so it gets nothing from the layer, as it does in the model.
"""

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from chronotope.errors import CaptureError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def _forward(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor,
             up: torch.Tensor | None, down: torch.Tensor, first: int, act: str) -> torch.Tensor:
    """``y_t``'s part from experts ``first .. first + len(gate) - 1`` (their weights'
    rows), for every token routed to one of them."""
    fn = ACTIVATIONS[act]
    out = torch.zeros_like(x)
    for e in range(gate.shape[0]):
        token, slot = torch.where(index == first + e)
        if token.numel() == 0:
            continue
        rows = x[token]
        hidden = fn(F.linear(rows, gate[e]))
        if up is not None:
            hidden = hidden * F.linear(rows, up[e])
        made = F.linear(hidden, down[e]) * weights[token, slot, None].to(x.dtype)
        out = out.index_add(0, token, made)
    return out


@torch.library.custom_op("chronotope::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                   gate: torch.Tensor, up: Optional[torch.Tensor],  # noqa: UP045 (the schema)
                   down: torch.Tensor, first: int, act: str) -> torch.Tensor:
    """Tokens ``x (t, d)`` through their ``index (t, k)`` experts, weighted by ``weights
    (t, k)``: ``down (e, d, f) @ act(gate (e, f, d) @ x) * (up (e, f, d) @ x)`` for the
    experts ``first ..`` these weights hold; without ``up``, ``down @ act(gate @ x)``."""
    return _forward(x, index, weights, gate, up, down, first, act)


@routed_experts.register_fake
def _(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor,
      up: torch.Tensor | None, down: torch.Tensor, first: int, act: str) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, index, weights, gate, up, down, first, act = inputs
    ctx.save_for_backward(x, index, weights, gate, up, down)
    ctx.first, ctx.act = first, act


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The forward made again under autograd, whose gradients it then takes: what the
    layer keeps for its backward is its inputs alone."""
    x, index, weights, gate, up, down = ctx.saved_tensors
    wanted = [ctx.needs_input_grad[i] and t is not None
              for i, t in zip((0, 2, 3, 4, 5), (x, weights, gate, up, down))]
    x, weights, gate, down = (t.detach().requires_grad_(w) for t, w in
                              zip((x, weights, gate, down), (wanted[0], *wanted[1:3], wanted[4])))
    up = up.detach().requires_grad_(wanted[3]) if up is not None else None
    with torch.enable_grad():
        out = _forward(x, index, weights, gate, up, down, ctx.first, ctx.act)
    asked = [t for t, w in zip((x, weights, gate, up, down), wanted) if w and t is not None]
    if asked and out.requires_grad:
        found = iter(torch.autograd.grad(out, asked, grad, allow_unused=True))
    else:  # no token routed to these experts: nothing flows back
        found = iter([torch.zeros_like(t) for t in asked])
    gx, gw, gg, gu, gd = (next(found) if w else None for w in wanted)
    return gx, None, gw, gg, gu, gd, None, None


routed_experts.register_autograd(_backward, setup_context=_setup)


def reach(experts: int, held: int, picks: int) -> float:
    """The chance that a token's ``picks`` experts of ``experts`` include one of ``held``
    of them, for a router that spreads its tokens evenly: the share of a rank's tokens
    that travel to a rank holding ``held`` experts."""
    return 1 - math.comb(experts - held, picks) / math.comb(experts, picks)


def first_expert(piece: Any) -> int:
    """The index of the first expert a piece of ``routed_experts`` holds (a plan's piece:
    the rows of the experts' gate weights it reads)."""
    return int(piece.inputs[3].mask.index[0][0])


def supported(module: nn.Module) -> str | None:
    """Why a Hugging Face experts module cannot run as ``routed_experts`` (None: it can)."""
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    if getattr(module, "has_bias", True) or getattr(module, "is_transposed", True) or \
            getattr(module, "has_post_expert_norm", True) or \
            not getattr(module, "is_concatenated", False):
        return "a layout other than gate and up side by side without biases"
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    if getattr(type(module), "_apply_gate", None) is not _default_gate():
        return "its own gate"
    weight = module.gate_up_proj if module.has_gate else getattr(module, "up_proj", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        return "experts' weights not stored as one (experts, out, in) tensor"
    return None


def _default_gate() -> Any:
    from transformers.integrations.moe import _default_apply_gate

    return _default_apply_gate


def _hugging_face(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface, as chronotope captures it: one op. Gate and up,
    side by side in one weight, are read as two slices of it, so that tensor parallelism
    gives each device its part of both (their hidden features)."""
    config: Any = module.config
    if module.has_gate:
        both: Any = module.gate_up_proj
        width = both.shape[1] // 2
        gate, up = both[:, :width], both[:, width:]
    else:
        gate, up = module.up_proj, None
    return routed_experts(hidden_states, top_k_index, top_k_weights, gate, up,
                          module.down_proj, 0, config.hidden_act)


def per_expert(module: nn.Module, act: str) -> str | None:
    """Why Switch Transformers' experts (one module per expert, its ``wi`` and ``wo``)
    cannot run as ``routed_experts`` with activation ``act`` (None: they can)."""
    experts = list(module.values())  # type: ignore[operator]
    if not all(isinstance(getattr(e, n, None), nn.Linear) and getattr(e, n).bias is None
               for e in experts for n in ("wi", "wo")):
        return "a layout other than wi and wo without biases"
    if any(e.dropout.p > 0 and e.training for e in experts):
        return "dropout between the experts' layers"
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    return None


def _switch(module: nn.Module, act: str, hidden_states: torch.Tensor,
            selected_experts: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
    """Switch Transformers' experts as one op: ``selected_experts`` (tokens, 1, experts)
    is one-hot, all zeros where the expert's capacity dropped the token; such a token is
    routed to no expert (-1) with weight 0."""
    kept = selected_experts.sum(-1)
    index = torch.where(kept > 0, selected_experts.argmax(-1), -1)
    experts = list(module.values())  # type: ignore[operator]
    gate = torch.stack([e.wi.weight for e in experts])
    down = torch.stack([e.wo.weight for e in experts])
    return routed_experts(hidden_states, index, routing_weights * kept, gate, None, down, 0,
                          act)


def _switch_experts(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "SwitchTransformersExperts"]


def _switch_act(model: nn.Module) -> str:
    """The activation of Switch Transformers' experts, as its config names it."""
    return str(getattr(getattr(model, "config", None), "dense_act_fn", ""))


def refuse_experts(model: nn.Module, name: str) -> None:
    """Raise where ``model`` has experts only ``routed_experts`` could capture (a loop over
    the experts its router picked) that it cannot run, naming why."""
    act = _switch_act(model)
    refused = sorted({why for m in _switch_experts(model) if (why := per_expert(m, act))})
    if refused:
        raise CaptureError(f"{name}: its Switch Transformers experts, a loop over the experts "
                           f"the router picked, are captured as one op, routed_experts, and "
                           f"these have {'; '.join(refused)}: it runs wi and wo without "
                           f"biases or dropout between them, activation one of "
                           f"{', '.join(ACTIVATIONS)}")


@contextlib.contextmanager
def hugging_face_experts(model: nn.Module) -> Iterator[None]:
    """While it is open, the Hugging Face experts modules of ``model`` that
    ``routed_experts`` can run (``supported``, ``per_expert``), all of them or none, run
    through it."""
    act = _switch_act(model)
    switch = _switch_experts(model)
    if switch and all(per_expert(m, act) is None for m in switch):
        for m in switch:
            m.forward = partial(_switch, m, act)
        try:
            yield
        finally:
            for m in switch:
                del m.forward
        return
    found = [m for m in model.modules() if hasattr(m, "_is_expert_parallel")
             and hasattr(getattr(m, "config", None), "_experts_implementation")]
    refused = {type(m).__name__: why for m in found if (why := supported(m)) is not None}
    if refused:
        warnings.warn(f"{', '.join(refused)}: run as written, not as routed_experts ("
                      f"{'; '.join(refused.values())}): plans split them op by op, and "
                      "expert parallelism cannot share them out", stacklevel=3)
    if not found or refused:
        yield
        return
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    configs: dict[int, Any] = {id(m.config): m.config for m in found}
    was = {key: c._experts_implementation for key, c in configs.items()}
    ALL_EXPERTS_FUNCTIONS["chronotope"] = _hugging_face
    try:
        for c in configs.values():
            c._experts_implementation = "chronotope"
        yield
    finally:
        for key, c in configs.items():
            c._experts_implementation = was[key]
        del ALL_EXPERTS_FUNCTIONS["chronotope"]
