"""A schedule written step by step, in the manner of the Slapo paper: each step is
verified against the unmodified model on one device (the built-in GPT, trained for a
step on 4 local ranks) and simulated on a GPT-3 1.3B-shaped model on 4 GPUs of a DGX
A100 (step time and memory per device).

    python docs/schedules/story.py
"""

import sys
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.compile.simulate import simulate
from chronotope.cost.network import cluster_for
from chronotope.models import get_workload
from chronotope.plan.check import format_bytes

sys.path.insert(0, str(Path(__file__).parent))
import megatron_block  # noqa: E402, F401  (registers sch.megatron)

DEVICES = 4


def data_parallel(sch):
    sch.replicate(DEVICES)


def sharded(sch):
    for i in range(len(sch["h"].module)):
        sch[f"h.{i}"].megatron()
    sch.replicate(DEVICES // 2)


def checkpointed(sch):
    sharded(sch)
    for i in range(len(sch["h"].module)):
        sch[f"h.{i}"].checkpoint()


def pipelined(sch):
    blocks = len(sch["h"].module)
    for i in range(blocks):
        sch[f"h.{i}"].megatron()
        sch[f"h.{i}"].checkpoint()
    sch[f"h.{blocks // 2 - 1}"].cut_pipeline_stage()
    sch.micro_batches(2, schedule="1f1b")


STEPS = [("the model as written, data parallel", data_parallel),
         ("+ Megatron shards (tp 2 x dp 2)", sharded),
         ("+ every block checkpointed", checkpointed),
         ("+ a pipeline cut (tp 2 x pp 2, 1F1B)", pipelined)]


def story(steps=STEPS) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = get_workload("gpt", batch_size=8)
        large = get_workload("gpt3-1.3b", device="meta", batch_size=8)
        graphs = {w.name: ct.capture(w) for w in (small, large)}
    rows = []
    for label, fn in steps:
        check = ct.schedule(small, devices=DEVICES, graph=graphs[small.name])
        fn(check)
        verified = check.verify(steps=1)
        sch = ct.schedule(large, devices=DEVICES, graph=graphs[large.name])
        fn(sch)
        sim = simulate(ct.compile(sch.plan()), cluster_for(DEVICES))
        rows.append({"step": label, "lines": len(sch.steps), "matches": verified.within(1e-5),
                     "step_time_s": sim.step_time,
                     "peak_memory": max(r.peak_memory for r in sim.ranks)})
    return rows


def main() -> None:
    table = Table(title=f"GPT-3 1.3B shape on {DEVICES} GPUs of a DGX A100 (simulated); "
                        "each step verified on the built-in GPT")
    for col in ("schedule", "primitive steps", "equal to one device", "step ms", "peak memory"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for row in story():
        table.add_row(row["step"], str(row["lines"]), "yes" if row["matches"] else "NO",
                      f"{row['step_time_s'] * 1e3:.1f}", format_bytes(row["peak_memory"]))
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
