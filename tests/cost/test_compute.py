"""Compute cost from signatures: FLOPs of the ops that dominate a transformer."""

import warnings

import torch

import chronotope as ct
from chronotope.cost import op_flops, piece_flops
from chronotope.models import get_workload
from chronotope.policies import mesh


def test_linear_and_attention_flops():
    b, s, d = 2, 32, 64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload("gpt", block_size=s, d_model=d, batch_size=b))
    qkv = next(op for op in graph if op.kind == "linear")
    assert op_flops(qkv) == 2 * b * s * d * 3 * d  # a multiply and an add per weight use
    attention = next(op for op in graph if op.kind == "attention")
    assert op_flops(attention) == 4 * b * s * s * d  # scores, then values, over all heads
    plan = mesh(graph, dp=2)
    halves = plan.leaves(attention.name)
    assert sum(piece_flops(p) for p in halves) == op_flops(attention)
    assert piece_flops(plan.backward_op(halves[0])) == op_flops(attention)  # 2x a half


def test_a_lookup_costs_one_row_per_index():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload("gpt", block_size=32, d_model=64, batch_size=2))
    lookup = next(op for op in graph if op.kind == "embedding")
    assert op_flops(lookup) == 2 * 32 * 64


class Join(torch.nn.Module):
    def forward(self, x):
        return torch.cat([x, 2 * x, 3 * x, 4 * x], dim=-1).sum()


def test_dims_of_one_tensor_alone_do_not_multiply_with_another_tensors():
    """A concatenation's inputs each have their own run of the joined dim: it moves one
    element per output element, not the product of every input's run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(ct.Workload(Join(), (torch.randn(2, 3, 512),)))
    cat = next(op for op in graph if op.name == "cat")
    assert op_flops(cat) == 2 * 3 * 4 * 512


def test_a_piece_is_bound_by_its_flops_or_its_bytes_whichever_take_longer():
    """On a GPU preset a matmul is priced by its FLOPs at the reachable share of the
    peak, an activation by the bytes it reads and writes (half of them under bf16); a
    view moves nothing and a lookup reads its rows, not its table."""
    from chronotope.cost import Traffic
    from chronotope.cost.network import cluster_for

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload("gpt", block_size=256, d_model=256, batch_size=8))
    a100 = cluster_for(8, "dgx-a100")
    linear = max((op for op in graph if op.kind == "linear"), key=op_flops)
    gelu = next(op for op in graph if op.kind == "gelu")
    fp32, bf16 = Traffic(graph), Traffic(graph, "bf16")

    def moved(traffic, op):
        return traffic.forward(op, [t.meta.numel for t in op.inputs],
                               [t.meta.numel for t in op.outputs])
    elements = gelu.inputs[0].meta.numel + gelu.outputs[0].meta.numel
    assert moved(fp32, gelu) == 4 * elements and moved(bf16, gelu) == 2 * elements
    assert a100.compute(op_flops(gelu), moved(bf16, gelu), "bf16") == \
        moved(bf16, gelu) / a100.copy_bandwidth
    assert a100.compute(op_flops(linear), moved(bf16, linear), "bf16") == \
        op_flops(linear) / (a100.peak("bf16") * a100.efficiency)
    views = [op for op in graph if op.kind in ("view", "reshape", "transpose", "split")]
    assert views and all(moved(fp32, op) == 0 for op in views)
    lookup = next(op for op in graph if op.kind == "embedding")
    index = next(t for t in lookup.inputs if not t.dtype.is_floating_point)
    assert moved(fp32, lookup) == 2 * 4 * lookup.outputs[0].meta.numel + \
        index.meta.numel * index.dtype.itemsize
