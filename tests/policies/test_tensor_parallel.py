"""Megatron tensor parallelism's cuts (``policies/mesh.py``'s ``tensor_parallel_dims``) on
layouts beyond the plain attention and MLP."""

import pytest

import chronotope as ct
from chronotope.compile.program import Exchange
from chronotope.graph.ir import TensorKind
from chronotope.policies import mesh
from chronotope.policies.mesh import tensor_parallel_dims
from tests.zoo.harness import capture
from tests.zoo.models import FAMILIES


def _by_weight(graph, suffix):
    """The ops that read a parameter whose name ends with ``suffix``, one per layer."""
    return [op for op in graph.ops if any(t.kind is TensorKind.PARAM and t.name.endswith(suffix)
                                          for t in op.inputs)]


@pytest.mark.parametrize("family", ["deepseek-v2", "deepseek-v3"])
def test_latent_attention_is_cut_by_its_heads_not_through_its_low_rank_projections(family):
    """Latent attention projects down to a small rank, normalizes, then up to the heads.
    Cut column-wise at the down projection, its norm would sum over the cut and the up
    projection would add the parts back: whole queries, keys and values on every device,
    attention run whole on each. The down projections stay whole; the up projections are
    cut by heads, attention with them, and the output projection sums the parts. The
    shared experts keep Megatron's pairing (gate and up by columns, down by rows)."""
    graph = capture(FAMILIES[family]())
    dims = tensor_parallel_dims(graph, 2)
    reduced = {op: {d.name for a in op.signature.inputs for ax in a for d in ax.factors
                    if d.reduce} for op in graph.ops if op.signature is not None}

    def cut(suffix, by):  # "column": a dim the op makes; "row": a dim it sums over
        ops = _by_weight(graph, suffix)
        assert ops, suffix
        for op in ops:
            split = dims[op]
            assert split is not None, (suffix, op.name)
            assert (split.dim in reduced[op]) == (by == "row"), (suffix, op.name, split)

    for down in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight"):
        assert all(dims[op] is None for op in _by_weight(graph, down)), down
    cut("q_b_proj.weight", "column")
    cut("kv_b_proj.weight", "column")
    cut("o_proj.weight", "row")
    cut("shared_experts.gate_proj.weight", "column")
    cut("shared_experts.up_proj.weight", "column")
    cut("shared_experts.down_proj.weight", "row")
    attention = [op for op in graph.ops if op.kind == "attention"]
    assert attention and all(dims[op] is not None for op in attention)


def test_latent_attention_s_lanes_route_their_tokens_lane_by_lane():
    """Its residual stream whole on every lane, each lane routes its tokens to the same lane
    of the other member (with the stream cut by features, the tokens went whole to every
    lane of the group)."""
    program = ct.compile(mesh(capture(FAMILIES["deepseek-v3"]()), dp=2, ep=2, tp=2))
    groups = [{ins.ranks for ins in code if isinstance(ins, Exchange)} for code in program.ranks]
    assert groups == [{(0, 2)}, {(1, 3)}, {(0, 2)}, {(1, 3)}], groups
