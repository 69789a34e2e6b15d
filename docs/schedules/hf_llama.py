"""Megatron tensor parallelism for Hugging Face Llama (``LlamaForCausalLM``).

    chronotope run hf-llama --schedule docs/schedules/hf_llama.py:megatron --devices 2 --check
"""


def megatron(sch):
    for i in range(len(sch["model.layers"].module)):
        attn, mlp = sch[f"model.layers.{i}.self_attn"], sch[f"model.layers.{i}.mlp"]
        for column in (attn["q_proj"], attn["k_proj"], attn["v_proj"],
                       mlp["gate_proj"], mlp["up_proj"]):
            column.shard("weight", axis=0)
        for row in (attn["o_proj"], mlp["down_proj"]):
            row.shard("weight", axis=1)
            row.sync(mode="fwd_post", op="all_reduce")
    sch["lm_head"].shard("weight", axis=0)
    sch["lm_head"].sync(mode="fwd_post", op="all_gather")
