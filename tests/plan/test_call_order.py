"""The primitives do not depend on the order they are called in: a plan written in any
order of the same calls compiles to the same program as the canonical order."""

import functools
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chronotope as ct
from chronotope.models import get_workload
from chronotope.plan import Plan, Split


@functools.cache
def graph():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(get_workload("gpt", n_layer=2))


def calls() -> list[tuple[str, str]]:
    """Two stages: each op placed on the device of its half; the linears cut in two along
    their output features (both pieces on that device); the first stage recomputed, and
    some backwards made early (as ordering by them does) before the placement."""
    ops = graph().ops
    half = len(ops) // 2
    out = []
    for i, op in enumerate(ops):
        out.append(("assign", op.name))
        if op.kind == "linear":
            out.append(("trans", op.name))
        if i < half and op.kind in ("linear", "gelu", "layer_norm"):
            out.append(("recompute", op.name))
        if i % 3 == 0:
            out.append(("backward", op.name))
    return out


def written(order: list[tuple[str, str]]) -> list[str]:
    """The plan made by ``order``'s calls, compiled: each rank's code."""
    g = graph()
    plan = Plan(g, 2)
    half = len(g.ops) // 2
    device = {op.name: int(i >= half) for i, op in enumerate(g.ops)}
    for call, name in order:
        if call == "assign":
            plan.assign(name, device[name])
        elif call == "trans":
            plan.trans(name, Split("n", 2))
        elif call == "recompute":
            plan.recompute(name)
        else:
            plan.leaves(plan.backward(name))  # makes the backward ops now
    program = ct.compile(plan)
    return [program.code(r) for r in range(2)]


@functools.cache
def canonical() -> tuple[str, ...]:
    return tuple(written(calls()))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.permutations(calls()))
def test_any_order_of_the_calls_makes_the_canonical_program(order):
    assert tuple(written(order)) == canonical()


def test_a_backward_made_before_its_forward_is_placed_follows_it():
    """The case that once kept a backward on the forward's first device (and failed to
    compile with a KeyError on the stale piece)."""
    g = graph()
    plan = Plan(g, 2)
    first = g.ops[5].name
    plan.leaves(plan.backward(first))
    for op in g.ops:
        plan.assign(op.name, 1 if op.name == first else 0)
    backward = plan.leaves(plan.backward(first))
    assert backward and all(b.device == 1 for b in backward)
    ct.compile(plan)
