"""Megatron tensor and sequence parallelism for the built-in GPT, with the ``megatron()``
primitive of ``megatron_block.py``: between blocks, the layer norms, residual adds and
dropouts run on each device's part of the sequence.

    chronotope run gpt --schedule docs/schedules/gpt_sequence.py:sequence_parallel \\
        --devices 2 --check
"""

import megatron_block  # noqa: F401  (registers the primitive)


def sequence_parallel(sch):
    for i in range(len(sch["h"].module)):
        sch[f"h.{i}"].megatron(sequence=True)
    sch["ln_f"].sync(mode="fwd_pre", op="all_gather")  # the last stretch: whole again
    sch["lm_head"].shard("weight", axis=0)
    sch["lm_head"].sync(mode="fwd_post", op="all_gather")
