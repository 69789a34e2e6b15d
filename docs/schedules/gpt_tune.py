"""A schedule with knobs for ``chronotope tune``: tensor parallel size, pipeline stages and
micro-batches (ranges that depend on the knobs before them), and how many blocks keep
no activations. 60 points on 4 devices.

    chronotope tune gpt --schedule docs/schedules/gpt_tune.py:tunable --devices 4 --batch-size 8
"""

import megatron_block  # noqa: F401  (registers sch.megatron)


def tunable(sch):
    blocks = len(sch["h"].module)
    tp = sch.knob("tp", [1, 2, 4])
    pp = sch.knob("pp", lambda k: [p for p in (1, 2, 4) if k["tp"] * p <= sch.devices])
    micro = sch.knob("micro", lambda k: [1, 2] if k["pp"] == 1 else [2, 4])
    ckpt = sch.knob("ckpt_ratio", [0, 0.25, 0.5, 0.75, 1.0])
    if tp > 1:
        for i in range(blocks):
            sch[f"h.{i}"].megatron()
    for stage in range(1, pp):
        sch[f"h.{blocks * stage // pp - 1}"].cut_pipeline_stage()
    sch.replicate(sch.devices // (tp * pp))
    sch.micro_batches(micro)
    for i in range(int(ckpt * blocks)):
        sch[f"h.{i}"].checkpoint()
