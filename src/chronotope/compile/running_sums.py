"""Running sums: a sum of three or more parts a rank computes is added up as the parts
are made, so only the running total and the newest part are alive.

Guarantees: the same sums, now made as ``Assemble(..., accumulate=True)`` steps right
after each part is made (co-shard's partial sums, forward and backward), and the
local parts of a gradient reduction made at different times (a tied weight's
gradient from each micro-batch) summed locally as they come, in their own dtype,
before the one collective. Nothing moves; no message or collective changes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from fractions import Fraction
from typing import TYPE_CHECKING

from chronotope.compile.program import (
    AllReduce,
    Assemble,
    Backward,
    Forward,
    Instruction,
    Part,
    ReduceScatter,
    covers,
    reads,
    sums_gradients,
    writes,
)

if TYPE_CHECKING:
    from chronotope.compile.passes import Lowered


def running_sums(rank: int, code: list[Instruction], lowered: Lowered) -> list[Instruction]:
    """``rank``'s code with its sums of three or more parts (and its reductions' local
    parts made apart) added up as the parts are made."""
    shapes = lowered.names.shapes[rank]
    made_at = {var: i for i, ins in enumerate(code) if isinstance(ins, (Forward, Backward))
               for var in writes(ins)}
    readers: dict[str, int] = defaultdict(int)
    for ins in code:
        for var in reads(ins):
            readers[var] += 1
    after: dict[int, list[Instruction]] = defaultdict(list)
    out = list(code)
    for i, ins in enumerate(code):
        if isinstance(ins, (AllReduce, ReduceScatter)) and not lowered.template and \
                _summed_as_made(ins, lowered):  # (a template's are summed by ``fold``)
            srcs = list(ins.srcs)
            for e, local in enumerate(ins.srcs):
                sizes = {shapes[v] for v in local if v in shapes}
                if len({made_at.get(v) for v in local}) < 2 or len(sizes) != 1 or any(
                        v not in made_at or readers[v] != 1 for v in local):
                    continue
                shape = sizes.pop()
                whole = tuple(slice(0, n) for n in shape)
                made = sorted(local, key=made_at.__getitem__)
                total = Part(made[0], whole, whole, Fraction(1))
                for k, v in enumerate(made[1:]):
                    var = lowered.names.fresh(rank, f"{ins.vars[e]}_partial", shape)
                    after[made_at[v]].append(Assemble(var, shape, ins.dtype, [
                        total, Part(v, whole, whole, Fraction(1))], accumulate=k > 0))
                    total = replace(total, src=var)
                srcs[e] = (total.src,)
            out[i] = replace(ins, srcs=tuple(srcs))
            continue
        if not (isinstance(ins, Assemble) and ins.pattern is None and len(ins.parts) > 2
                and all(p.scale == 1 and p.src in made_at and readers[p.src] == 1
                        and shapes.get(p.src) == ins.shape  # all of it
                        and covers(p.src_slices, ins.shape)
                        and covers(p.dst_slices, ins.shape) for p in ins.parts)):
            continue
        parts = sorted(ins.parts, key=lambda p: made_at[p.src])
        if len({made_at[p.src] for p in parts}) < 3:
            continue  # made together (one backward region): nothing to gain
        total = parts[0]
        for k, p in enumerate(parts[1:-1]):  # the totals made here are added into
            var = lowered.names.fresh(rank, f"{ins.var}_partial", ins.shape)
            after[made_at[p.src]].append(Assemble(var, ins.shape, ins.dtype, [total, p],
                                                  accumulate=k > 0))
            total = replace(total, src=var)
        out[i] = replace(ins, parts=[total, parts[-1]], accumulate=len(parts) > 2)
    return [x for i, ins in enumerate(out) for x in (ins, *after.get(i, ()))]


def _summed_as_made(ins: AllReduce | ReduceScatter, lowered: Lowered) -> bool:
    """Whether a reduction's local pieces may be summed before it, in their own dtype:
    gradients, in fp32 (a parameter's always is)."""
    plan = lowered.plan
    params = {plan.grads[t].name for t in plan.graph.params.values() if t in plan.grads}
    return sums_gradients(ins.keys) and (plan.dtype == "fp32" or all(
        k.tensor in params for k in ins.keys))
