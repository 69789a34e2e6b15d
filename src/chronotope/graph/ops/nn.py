"""Signatures of contractions (linear, matmul, einsum), embedding, attention and factories."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from chronotope.graph.ops.pointwise import join, names
from chronotope.graph.registry import OpCall, OpRegistry, method

aten = torch.ops.aten


def linear(call: OpCall) -> str:
    """``x (*, k), w (n, k), b (n) -> (*, n)``: ``k`` is a reduction dim, the bias is additive."""
    x, *rest = call.tensors
    lead = names(len(x.shape) - 1, "b")
    ins = [[*lead, "k+"], ["n", "k+"]]
    if len(rest) > 1:
        ins.append(["n"])
    return f"{join(*ins)} -> {' '.join([*lead, 'n'])}"


def _batch_dims(shapes: list[tuple[int, ...]], out_batch: tuple[int, ...]) -> list[list[str]]:
    """Broadcast batch dims of several operands against the output's, aligned from the right."""
    onames = names(len(out_batch), "b")
    result = []
    for shape in shapes:
        offset = len(out_batch) - len(shape)
        result.append(
            ["1" if s == 1 and out_batch[offset + j] != 1 else onames[offset + j]
             for j, s in enumerate(shape)]
        )
    return result


def matmul(call: OpCall) -> str | None:
    """``torch.matmul`` with its 1-D and broadcasting cases."""
    a, b = call.tensors[:2]
    out = call.out.shape
    if len(a.shape) == 1 and len(b.shape) == 1:
        return "k+, k+ -> "
    if len(a.shape) == 1:
        (bb,) = _batch_dims([b.shape[:-2]], out[:-1])
        return f"k+, {' '.join([*bb, 'k+', 'n'])} -> {' '.join([*names(len(out) - 1, 'b'), 'n'])}"
    if len(b.shape) == 1:
        (ab,) = _batch_dims([a.shape[:-2]], out[:-1])
        return f"{' '.join([*ab, 'm', 'k+'])}, k+ -> {' '.join([*names(len(out) - 1, 'b'), 'm'])}"
    ab, bb = _batch_dims([a.shape[:-2], b.shape[:-2]], out[:-2])
    ob = names(len(out) - 2, "b")
    return f"{join([*ab, 'm', 'k+'], [*bb, 'k+', 'n'])} -> {' '.join([*ob, 'm', 'n'])}"


def addmm(call: OpCall) -> str:
    """``bias + a @ b`` (addmm, baddbmm): the bias is additive and broadcasts to the output."""
    bias, a, b = call.tensors[:3]
    out = call.out.shape
    batch = names(len(out) - 2, "b")
    onames = [*batch, "m", "n"]
    offset = len(out) - len(bias.shape)
    bias_dims = ["1" if s == 1 and out[offset + j] != 1 else onames[offset + j]
                 for j, s in enumerate(bias.shape)]
    return f"{join(bias_dims, [*batch, 'm', 'k+'], [*batch, 'k+', 'n'])} -> {' '.join(onames)}"


def einsum(call: OpCall) -> str | None:
    """An einsum equation is already a signature: letters missing from the output reduce."""
    equation = call.args[0].replace(" ", "")
    operands = call.tensors
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        return None
    if not _:
        rhs = "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
        if "..." in lhs:
            rhs = "..." + rhs
    ell = max((len(t.shape) - len(term.replace("...", "")) for term, t in zip(terms, operands)
               if "..." in term), default=0)
    out_batch = call.out.shape[: ell] if "..." in rhs else ()
    ell_names = names(ell, "e")

    def dims(term: str, shape: tuple[int, ...] | None) -> list[str] | None:
        head, dots, tail = term.partition("...")
        if len(set(head + tail)) != len(head + tail):
            return None  # a repeated letter takes a diagonal: no split rule
        middle: list[str] = []
        if dots:
            n = len(shape) - len(head) - len(tail) if shape is not None else ell
            middle = ell_names[ell - n:]
            if shape is not None and out_batch:
                sub = shape[len(head): len(head) + n]
                middle = ["1" if s == 1 and out_batch[ell - n + j] != 1 else m
                          for j, (s, m) in enumerate(zip(sub, middle))]
        reduce = [] if shape is None else [c for c in head + tail if c not in rhs]
        return [c + "+" if c in reduce else c for c in head] + middle + \
            [c + "+" if c in reduce else c for c in tail]

    ins = [dims(term, t.shape) for term, t in zip(terms, operands)]
    out = dims(rhs, None)
    if out is None or any(i is None for i in ins):
        return None
    return f"{join(*ins)} -> {' '.join(out)}"


def embedding(weight_first: bool):
    """Rows looked up from a ``(v, d)`` table; the vocabulary dim is never split."""

    def rule(call: OpCall) -> str:
        weight, idx = call.tensors[:2] if weight_first else call.tensors[1::-1]
        lead = names(len(idx.shape), "b")
        table = ["v^", "d"]
        ins = [table, lead] if weight_first else [lead, table]
        return f"{join(*ins)} -> {' '.join([*lead, 'd'])}"

    return rule


def one_hot(call: OpCall) -> str:
    lead = names(len(call.tensors[0].shape), "b")
    return f"{' '.join(lead)} -> {' '.join([*lead, 'c^'])}"


def attention(call: OpCall) -> str | None:
    """Scaled dot-product attention ``q (*, L, E), k (*, S, E), v (*, S, Ev) -> (*, L, Ev)``.

    The softmax runs over ``S`` and ``E`` sits under it, so neither splits; query
    rows split, a causal piece masking by where its rows sit (``graph/attention.py``).
    """
    q, k, v = call.tensors[:3]
    out = call.out.shape
    gqa = bool(call.arg(7, "enable_gqa", False))
    nb = len(out) - 2
    qb, kb, vb = _batch_dims([q.shape[:-2], k.shape[:-2], v.shape[:-2]], out[:-2])
    if gqa and nb >= 1 and k.shape[-3] != q.shape[-3]:
        qb[-1], kb[-1], vb[-1] = qb[-1] + "^", "hk^", "hk^"
    ins = [[*qb, "L", "E^"], [*kb, "S^", "E^"], [*vb, "S^", "Ev"]]
    if len(call.tensors) > 3:  # attn_mask broadcasts to (*, L, S)
        mask = call.tensors[3]
        full = (*out[:-2], out[-2], k.shape[-2])
        onames = [*[n.rstrip("^") for n in qb], "L", "S^"]
        onames = [*names(nb, "b"), "L", "S^"] if len(onames) != len(full) else onames
        offset = len(full) - len(mask.shape)
        ins.append(["1" if s == 1 and full[offset + j] != 1 else onames[offset + j]
                    for j, s in enumerate(mask.shape)])
    ob = [n.rstrip("^") if n != "1" else f"b{i}" for i, n in enumerate(qb)]
    if gqa and qb and qb[-1].endswith("^"):
        ob[-1] = qb[-1]
    return f"{join(*ins)} -> {' '.join([*ob, 'L', 'Ev'])}"


def factory(frozen: bool):
    """Ops that make a tensor from sizes alone; random or positional values never split."""

    def rule(call: OpCall) -> str:
        outs = [[f"d{i}^" if frozen else f"d{i}" for i in range(len(o.shape))]
                for o in call.outputs]
        ins = [["1" if s == 1 else f"t{j}_{i}^" for i, s in enumerate(t.shape)]
               for j, t in enumerate(call.tensors)]
        if not frozen and len(ins) == 1 and call.tensors[0].shape == call.out.shape:
            ins = outs[:1]  # x.new_zeros(x.shape): a piece makes its own slice of x's shape
        return f"{join(*ins)} -> {join(*outs)}"

    return rule


def recurrent(call: OpCall) -> str | None:
    """``lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` on padded batches (not packed ones):
    the batch splits, each piece running the whole recurrence over its rows with the whole
    weights; the time, feature and layer dims are frozen. With dropout between the layers
    in training the op draws from torch's generator, which no piece can replay: no split."""
    a = call.args
    if len(a) != 9 or not isinstance(a[3], bool) or not isinstance(a[8], bool):
        return None  # a packed sequence: (data, batch_sizes, hx, params, ...)
    dropout, train, batch_first = a[5], a[6], a[8]
    tensors = call.tensors
    x = tensors[0]
    if len(x.shape) != 3 or (dropout and train and a[4] > 1):
        return None
    hidden = list(a[1]) if isinstance(a[1], (tuple, list)) else [a[1]]
    ins = [["b", "t^", "i^"] if batch_first else ["t^", "b", "i^"]]
    ins += [[f"l{k}^", "b", f"h{k}^"] for k in range(len(hidden))]
    ins += [[f"w{k}_{i}^" for i in range(len(w.shape))]
            for k, w in enumerate(tensors[1 + len(hidden):])]
    outs = [["b", "t^", "o^"] if batch_first else ["t^", "b", "o^"]]
    outs += [[f"l{k}^", "b", f"h{k}^"] for k in range(len(call.outputs) - 1)]
    return f"{join(*ins)} -> {join(*outs)}"


def _targets(*names_: str) -> list[object]:
    found: list[object] = []
    for name in names_:
        found += [getattr(ns, name) for ns in (torch, aten) if hasattr(ns, name)]
    return found


def register(reg: OpRegistry) -> None:
    reg.add([F.linear, aten.linear], "linear", linear, additive_inputs=(2,))
    reg.add([torch.matmul, operator.matmul, *method("matmul", "__matmul__"), aten.matmul],
            "matmul", matmul)
    reg.add([torch.mm, torch.bmm, *method("mm", "bmm"), aten.mm, aten.bmm], "matmul", matmul)
    reg.add([torch.addmm, torch.baddbmm, *method("addmm", "baddbmm"), aten.addmm, aten.baddbmm],
            "addmm", addmm, additive_inputs=(0,))
    reg.add([torch.einsum, aten.einsum], "einsum", einsum)
    reg.add([torch.outer, torch.ger, *method("outer"), aten.outer], "outer",
            lambda c: "m, n -> m n")
    reg.add([F.embedding], "embedding", embedding(weight_first=False))
    reg.add([torch.embedding, aten.embedding], "embedding", embedding(weight_first=True))
    reg.add([F.one_hot, aten.one_hot], "one_hot", one_hot)
    reg.add([F.scaled_dot_product_attention, aten.scaled_dot_product_attention],
            "attention", attention)
    reg.add([torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu, aten.lstm, aten.gru,
             aten.rnn_tanh, aten.rnn_relu], "recurrent", recurrent)
    reg.add(_targets("ones", "zeros", "full", "empty", "new_ones", "new_zeros", "new_full",
                     "new_empty")
            + method("new_ones", "new_zeros", "new_full", "new_empty"),
            "fill", factory(frozen=False))
    reg.add(_targets("arange", "randn", "rand", "randint", "rand_like", "randn_like",
                     "randint_like", "tensor", "scalar_tensor", "linspace", "eye", "normal",
                     "bernoulli", "randperm"),
            "factory", factory(frozen=True))
