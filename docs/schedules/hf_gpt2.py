"""Megatron tensor parallelism for Hugging Face GPT-2 (``GPT2LMHeadModel``).

GPT-2's projections are ``Conv1D`` modules whose weight is (in, out): the column
cut is axis 1 of the weight (and axis 0 of the bias), the row cut axis 0.

    chronotope run hf-gpt2 --schedule docs/schedules/hf_gpt2.py:megatron --devices 2 --check
"""


def megatron(sch):
    for i in range(len(sch["transformer.h"].module)):
        attn, mlp = sch[f"transformer.h.{i}.attn"], sch[f"transformer.h.{i}.mlp"]
        for column, row in ((attn["c_attn"], attn["c_proj"]), (mlp["c_fc"], mlp["c_proj"])):
            column.shard("weight", axis=1)
            column.shard("bias", axis=0)
            column.sync(mode="bwd_post", op="all_reduce")
            row.shard("weight", axis=0)
            row.sync(mode="fwd_post", op="all_reduce")
    sch["lm_head"].shard("weight", axis=0)  # tied to the token embedding
    sch["lm_head"].sync(mode="fwd_post", op="all_gather")
