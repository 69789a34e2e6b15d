"""Megatron tensor parallelism for the built-in GPT, written module by module.

    chronotope run gpt --schedule docs/schedules/gpt_megatron.py:megatron --devices 2 --check
"""


def megatron(sch):
    for i in range(len(sch["h"].module)):
        attn, mlp = sch[f"h.{i}.attn"], sch[f"h.{i}.mlp"]
        attn["c_attn"].shard(["weight", "bias"], axis=0)  # column: q, k, v by heads
        attn["c_attn"].sync(mode="bwd_post", op="all_reduce")
        attn["c_proj"].shard("weight", axis=1)  # row: partial sums
        attn["c_proj"].sync(mode="fwd_post", op="all_reduce")
        mlp["c_fc"].shard(["weight", "bias"], axis=0)
        mlp["c_fc"].sync(mode="bwd_post", op="all_reduce")
        mlp["c_proj"].shard("weight", axis=1)
        mlp["c_proj"].sync(mode="fwd_post", op="all_reduce")
    sch["lm_head"].shard("weight", axis=0)  # the vocabulary's columns
    sch["lm_head"].sync(mode="fwd_post", op="all_gather")
