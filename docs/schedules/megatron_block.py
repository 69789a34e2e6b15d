"""A schedule primitive of one's own: Megatron tensor parallelism for any block.

``@ct.schedule_primitive`` gives every schedule a ``megatron()`` step. It reads the
block's captured ops: a projection by a weight matrix that reads what no other
projection of the block made is cut by its output features (column parallel), and
one that reads what a column projection made, through the attention or activation
between them, by the features it sums over (row parallel), synced after. The weight
axis comes from each op's signature, so ``nn.Linear``'s (out, in) weights and GPT-2's
``Conv1D`` (in, out) are cut alike, and no module name is written down.

    import chronotope as ct
    import megatron_block  # noqa: F401  (registers the primitive)

    sch = ct.schedule(model, batch, devices=2)
    for i in range(layers):
        sch[f"model.layers.{i}"].megatron()
"""

import chronotope as ct
from chronotope.graph.ir import TensorKind


@ct.schedule_primitive
def megatron(sch, sequence=False):
    """``sequence``: Megatron's sequence parallelism too. What a row projection leaves is
    reduce-scattered along the sequence, so the norms and residual adds between blocks run
    on a part of it, and each column projection all-gathers it back."""
    cut = set()  # tensors made from a column projection's output, within the block
    for op in sch.ops():
        found = _projection(op)
        if found is None:
            if any(t in cut for t in op.inputs):
                cut.update(op.outputs)
            continue
        weight, summed, kept, features = found
        module = sch[op.source.module[len(sch.path) + 1:]] if sch.path else sch[op.source.module]
        if any(t in cut for t in op.inputs):  # row: reads the cut features, sums over them
            module.shard(_local(weight, module), axis=summed)
            module.sync(mode="fwd_post", op="reduce_scatter" if sequence else "all_reduce")
            continue
        module.shard(_local(weight, module), axis=kept)  # column
        for bias in _biases(op, features):
            module.shard(_local(bias, module), axis=0)
        if sequence:  # (its input gradient is then reduce-scattered, or all-reduced in
            module.sync(mode="fwd_pre", op="all_gather")  # a first block: derived alike)
        else:
            module.sync(mode="bwd_post", op="all_reduce")
        cut.update(op.outputs)
    return sch


def _projection(op):
    """(weight, its summed axis, its kept axis, the kept dim) of an op that multiplies by a
    2-D parameter, or None."""
    sig = op.signature
    if sig is None or not sig.outputs:
        return None
    made = {axis.factors[0].name for axis in sig.outputs[0]}
    for t, dims in zip(op.inputs, sig.inputs):
        if t.kind is TensorKind.PARAM and len(dims) == 2:
            leads = [axis.factors[0] for axis in dims]
            summed = [a for a, d in enumerate(leads) if d.reduce]
            kept = [a for a, d in enumerate(leads) if not d.reduce and d.name in made]
            if summed and kept:
                return t, summed[0], kept[0], leads[kept[0]].name
    return None


def _biases(op, features):
    return [t for t, dims in zip(op.inputs, op.signature.inputs) if t.kind is TensorKind.PARAM
            and len(dims) == 1 and dims[0].factors[0].name == features]


def _local(param, module):
    return param.name[len(module.path) + 1:]
