"""Automatic plan search: how long it takes to decide, and how good its plans are.

    python benchmarks/search.py [--quick] [--skip-scale] [--model M] [--cluster C]
    python benchmarks/search.py --knobs        # the two tables of the mesh family alone
    python benchmarks/search.py --agreement    # the search's models against the simulator

One table, everything priced on this machine without a GPU or profiling:

* speed rows: the time to decide (strategies, the ILP on every mesh, the stage DP's
  pipelines; D-Rec alone) for GPT-3 39B on 64 devices (8 x DGX A100) and GPT-3 175B and
  Llama-70B on 1,024; where the plan is small enough to build, building it and checking
  its memory estimate are timed apart. Goals: 39B <= 10 s, D-Rec <= 2 s, 1,024 <= 60 s.
* end to end (``--end-to-end``, a second table): each tiny built-in model and a user's
  model file searched for 2 and 4 processes and run with ``run --plan PLAN --check``
  on gloo processes against one device.
* the mesh family at scale (``--knobs``): GPT-3 175B in bf16 on 64 to 4,096 A100s and
  Llama-3 70B on 1,024 H100s, global batch 1,536: the plan found, its step and memory by
  the search's model and the plan's estimate, and the time and memory the search took
  (each case in a fresh process). Goal: 1,024 devices in <= 60 s and 8 GB.
* Megatron-LM's published plans (``--knobs``; Narayanan et al., SC'21, Table 1): each
  row's model, batch and A100 cluster, its tensor and pipeline degrees priced by the same
  model as the search's plan (with the micro-batches and recompute that suit them best:
  the table does not list them), and the TFLOP/s per GPU each implies beside the
  measured one. Goal: searched <= 1.00x published.
* the models against the simulator (``--agreement``): the step each of the search's cost
  models predicts (the mesh family's points, every option the ILP and the stage DP rank)
  against the simulated step of the plan it builds, GPT-3 1.3B cut to 8 layers on one
  DGX A100 and on two DGX-1 V100 nodes. Goal: within 15%.
* quality rows: for each model and cluster, the mesh family's, the ILP's and D-Rec's plans
  against the best plan of a grid over the built-in policies and degrees (dp, zero-1/2/3, dp with
  accumulation or recompute, tp, tp with sequence parallel and recompute, dp x tp,
  pipelines x schedules x micro-batches, with recompute) that fits the device's memory,
  all compiled and priced by the same simulator. Goal: <= 1.00x.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

import chronotope as ct
from chronotope.compile.simulate import simulate
from chronotope.cost.network import cluster_for
from chronotope.errors import ChronotopeError
from chronotope.models import get_workload
from chronotope.search import SearchError, ilp_options, search
from chronotope.search.drec import drec

SCALE = [("gpt3-39b", 64, 16), ("gpt3-175b", 1024, 1024), ("llama-70b", 1024, 1024)]
MODELS = {  # name: (built-in, batch, overrides): the tiny t5 and swin at base sizes; the
    # large models with fewer layers of their real width, so that their grids compile here
    "gpt3-1.3b": ("gpt3-1.3b", 16, {}),
    "gpt3-13b (8 of 40 layers)": ("gpt3-13b", 16, dict(n_layer=8)),
    "llama-70b (4 of 80 layers)": ("llama-70b", 16, dict(n_layer=4)),
    "t5-base": ("t5", 16, dict(vocab_size=32128, d_model=768, d_kv=64, d_ffn=3072, n_head=12,
                               n_enc_layer=12, n_dec_layer=12, src_len=512, tgt_len=128)),
    "swin-base": ("swin", 32, dict(img_size=224, patch_size=4, embed_dim=128,
                                   depths=(2, 2, 18, 2), n_heads=(4, 8, 16, 32), window=7,
                                   num_classes=1000)),
}
CLUSTERS = ["dgx-a100x1", "dgx1-v100x2", "dgx-a100x4"]
WIDE = {"gpt3-1.3b", "gpt3-13b (8 of 40 layers)"}  # the models also priced on 32 devices
TINY = ["gpt", "llama", "bert", "t5", "swin", "evoformer",
        "examples/shakespeare/model.py:char_gpt"]


def captured(name: str, batch: int, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(get_workload(name, device="meta", batch_size=batch, **overrides))


def replicas_of(name: str, batch: int, **overrides):
    """The graph of ``1 / r`` of the batch, as the CLI gives the search (``replica=``)."""
    workload = get_workload(name, device="meta", batch_size=batch, **overrides)

    def replica(r: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ct.capture(workload.replica(r))
    return replica


def grid(graph, devices: int, per_node: int):
    """Every built-in policy and degree: (label, plan maker)."""
    mesh = ct.policies.mesh
    out = [("dp", lambda: mesh(graph, dp=devices))]
    out += [(f"zero-{s}", lambda s=s: ct.policies.zero(graph, devices, stage=s)) for s in (1, 2, 3)]
    for micro in (2, 4):  # gradient accumulation: one micro-batch's activations at a time
        out.append((f"dp, {micro} micro-batches", lambda m=micro: mesh(
            graph, dp=devices, micro=m, fold=True)))
    out.append(("dp, recompute full", lambda: mesh(graph, dp=devices, recompute="full")))
    for tp in (t for t in (2, 4, 8) if t <= per_node and devices % t == 0):
        dp = devices // tp
        out.append((f"dp {dp} x tp {tp}", lambda dp=dp, tp=tp: mesh(graph, dp=dp, tp=tp)))
        out.append((f"dp {dp} x tp {tp} + sp",
                    lambda dp=dp, tp=tp: mesh(graph, dp=dp, tp=tp, sequence=True)))
        out.append((f"dp {dp} x tp {tp} + sp, recompute full", lambda dp=dp, tp=tp: mesh(
            graph, dp=dp, tp=tp, sequence=True, recompute="full")))
    for pp in (2, 4):
        for schedule in ("gpipe", "1f1b"):
            for micro in (pp, 2 * pp):
                dp = devices // pp
                out.append((f"dp {dp} x pp {pp} {schedule} {micro}mb",
                            lambda dp=dp, pp=pp, s=schedule, m=micro:
                            mesh(graph, dp=dp, pp=pp, micro=m, schedule=s)))
        out.append((f"dp {devices // pp} x pp {pp} 1f1b {2 * pp}mb, recompute full",
                    lambda pp=pp: mesh(graph, dp=devices // pp, pp=pp, micro=2 * pp,
                                       schedule="1f1b", recompute="full")))
    return out


def priced(plan, cluster) -> tuple[float, float]:
    """(simulated step seconds, the plan's peak memory estimate per device)."""
    peak = max(m.total for m in plan.check().memory.values())
    return simulate(ct.compile(plan, cluster=cluster), cluster).step_time, peak


def quality_rows(table: Table, models: list[str], clusters: list[str]) -> None:
    for model in models:
        name, batch, overrides = MODELS[model]
        graph = captured(name, batch, **overrides)
        for spec in clusters:
            if spec == CLUSTERS[2] and model not in WIDE:
                continue
            cluster = cluster_for(0, spec)
            devices = cluster.nodes * cluster.per_node
            best = None
            for label, make in grid(graph, devices, cluster.per_node):
                try:
                    step, peak = priced(make(), cluster)
                except ChronotopeError:
                    continue  # a degree the model does not divide
                if peak <= cluster.memory and (best is None or step < best[1]):
                    best = (label, step)
            found = {}
            for method in ("mesh", "ilp", "drec"):
                start = time.perf_counter()
                try:
                    r = search(graph, devices, cluster, memory=cluster.memory, method=method,
                               replica=replicas_of(name, batch, **overrides))
                except ChronotopeError as e:
                    found[method] = (str(e)[:40], None, time.perf_counter() - start)
                    continue
                found[method] = (r.mesh, r.predicted_step_s, r.search_s)
                finals = [(e["option"], round(e["model_step_s"] * 1e3),
                           round(e["simulated_step_s"] * 1e3))
                          for e in r.explored if "simulated_step_s" in e]
                if finals:  # the cost model against the simulator, in ms
                    print(f"  {method} finalists (option, model ms, simulated ms): {finals}",
                          file=sys.stderr, flush=True)
            knobs, ilp, dr = found["mesh"], found["ilp"], found["drec"]
            print(f"{model} on {spec}: mesh {knobs}, ilp {ilp}, drec {dr}, best {best}",
                  file=sys.stderr, flush=True)
            table.add_row(
                f"{model} on {spec}", f"{devices}",
                f"{knobs[0]}: {_ratio(knobs[1], best)} ({knobs[2]:.1f} s)",
                f"{ilp[0]}: {_ratio(ilp[1], best)} ({ilp[2]:.1f} s)",
                f"{dr[0]}: {_ratio(dr[1], best)} ({dr[2]:.1f} s)",
                "nothing fits" if best is None else f"{best[0]}: {best[1] * 1e3:.0f} ms", "")


def _ratio(step: float | None, best: tuple[str, float] | None) -> str:
    return "-" if step is None or best is None else f"{step / best[1]:.3f}x"


def scale_rows(table: Table, cases) -> None:
    for model, devices, batch in cases:
        graph = captured(model, batch)
        cluster = cluster_for(devices)
        start, note = time.perf_counter(), ""
        try:
            options, variables = ilp_options(graph, devices, cluster, cluster.memory)
        except SearchError as e:  # say so, and time the search without the limit
            note = f"nothing fits ({str(e).split(': ')[1]}); unbounded: "
            start = time.perf_counter()
            options, variables = ilp_options(graph, devices, cluster, None)
        decided = time.perf_counter() - start
        start = time.perf_counter()
        drec(graph, devices)
        drec_s = time.perf_counter() - start
        seconds, best = options[0]
        label = best.label if hasattr(best, "label") else f"mesh {best[0].mesh}"
        note += f"{variables:,} variables; model step {seconds:.2f} s"
        if devices <= 64:  # small enough to build and check here
            r = search(graph, devices, cluster, memory=cluster.memory, method="ilp",
                       simulate=False)
            note += (f"; build {r.timings.get('build', 0):.1f} s, check "
                     f"{r.timings.get('check', 0):.1f} s")
        table.add_row(f"{model} on {cluster.name}", f"{devices:,}", "",
                      f"decide {decided:.1f} s: {label}", f"D-Rec alone {drec_s:.2f} s",
                      "", note)


def end_to_end(models: list[str]) -> Table:
    """Search, write the plan, run it on gloo processes checked against one device."""
    table = Table(title="searched plans run end to end: run --plan PLAN --check (gloo)")
    for col in ("model", "processes", "plan found", "search s", "matches one device"):
        table.add_column(col)
    cli = [sys.executable, "-m", "chronotope.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for n in (2, 4):
                path = Path(tmp) / f"{model.replace('/', '_')}-{n}.json"
                found = subprocess.run([*cli, "search", model, "--devices", str(n), "--out",
                                        str(path), "--json"], capture_output=True, text=True)
                if found.returncode:
                    table.add_row(model, str(n), found.stderr.strip()[-60:], "-", "no")
                    continue
                report = json.loads(found.stdout)
                ran = subprocess.run([*cli, "run", model, "--plan", str(path), "--steps", "2",
                                      "--check", "--json"], capture_output=True, text=True)
                match = not ran.returncode and json.loads(ran.stdout).get("match")
                table.add_row(model, str(n), f"{report['method']} {report['mesh']}",
                              f"{report['search_s']:.1f}",
                              "yes" if match else f"NO: {ran.stderr.strip()[-60:]}")
    return table


# Narayanan et al. (SC'21), Table 1: parameters (billions), heads, hidden, layers, tensor
# and pipeline degrees, GPUs, global batch, measured TFLOP/s per GPU (sequence 2,048,
# vocabulary 51,200, A100 80 GB DGX nodes, 16-bit).
MEGATRON = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
            (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
            (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
            (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
            (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
            (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
            (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148)]
KNOB_SCALE = [("gpt3-175b", 64, "dgx-a100"), ("gpt3-175b", 256, "dgx-a100"),
              ("gpt3-175b", 1024, "dgx-a100"), ("gpt3-175b", 4096, "dgx-a100"),
              ("llama3-70b", 1024, "h100-sxm")]


def _knob_case(model: str, devices: int, preset: str, batch: int) -> dict:
    """One search at scale, in a fresh process: its seconds and peak memory (RSS)."""
    import resource

    start = time.perf_counter()
    workload = get_workload(model, device="meta", batch_size=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(workload, check_up_to=0)

        def replica(r):
            return ct.capture(workload.replica(r), check_up_to=0)

        captured = time.perf_counter() - start
        cluster = cluster_for(devices, preset)
        r = search(graph, devices, cluster, method="mesh", dtype="bf16", replica=replica,
                   simulate=False)
    explored = next(e for e in r.explored if e.get("option") == r.mesh)
    return {"capture_s": captured, "search_s": time.perf_counter() - start - captured,
            "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
            "mesh": r.mesh, "step_s": r.predicted_step_s,
            "model_memory": explored["model_memory_bytes"], "memory": max(r.peak_memory_bytes),
            "timings": r.timings}


def knob_scale_table() -> Table:
    import multiprocessing

    table = Table(title="the mesh family at scale: GPT-3 175B / Llama-3 70B, bf16, global "
                        "batch 1,536 (search's model; each case in a fresh process)")
    for col in ("case", "devices", "plan found", "step s", "memory model / plan estimate",
                "capture s", "search s", "peak RSS GB"):
        table.add_column(col, justify="left" if col in ("case", "plan found") else "right")
    ctx = multiprocessing.get_context("spawn")
    for model, devices, preset in KNOB_SCALE:
        with ctx.Pool(1) as pool:
            c = pool.apply(_knob_case, (model, devices, preset, 1536))
        table.add_row(f"{model} on {preset}", f"{devices:,}", c["mesh"], f"{c['step_s']:.2f}",
                      f"{c['model_memory'] / 2**30:.1f} / {c['memory'] / 2**30:.1f} GiB",
                      f"{c['capture_s']:.1f}", f"{c['search_s']:.1f}", f"{c['rss_gb']:.1f}")
        print(f"{model} on {devices}: {c}", file=sys.stderr, flush=True)
    return table


def agreement_table() -> Table:
    """The search's cost models against the simulator, option by option: the mesh
    family's points and every option the ILP and the stage DP rank (the finalists come
    from these), on one DGX A100 and on two DGX-1 V100 nodes (goal: within 15%)."""
    from chronotope.search import _Clock, _pipeline_plan, ilp_options, solution_plan
    from chronotope.search.knobs import Knobs, Model
    from chronotope.search.stages import Pipeline

    table = Table(title="the search's models vs the simulator: GPT-3 1.3B cut to 8 layers, "
                        "batch 16, fp32 (ratio: model / simulated; goal 0.85-1.15)")
    for col in ("cluster", "family", "option", "model ms", "simulated ms", "ratio"):
        table.add_column(col, justify="left" if col in ("cluster", "family", "option")
                         else "right")
    graph = captured("gpt3-1.3b", 16, n_layer=8)
    replica = replicas_of("gpt3-1.3b", 16, n_layer=8)
    for spec in ("dgx-a100x1", "dgx1-v100x2"):
        cluster = cluster_for(0, spec)
        devices = cluster.nodes * cluster.per_node
        model = Model(graph, cluster, "fp32")
        rows = []
        for knobs in (Knobs(devices, 1, 1, 1), Knobs(devices // 4, 4, 1, 4),
                      Knobs(1, 8, devices // 8, 8), Knobs(devices // 4, 1, 4, 4),
                      Knobs(devices // 4, 1, 4, 4, chunks=2),
                      Knobs(devices // 4, 2, 2, 4, recompute="full"),
                      Knobs(devices // 8, 4, 2, 8, sequence=True),
                      Knobs(devices // 4, 1, 4, 4, shard=True),
                      Knobs(devices // 4, 1, 4, 4, zero_bubble=True),
                      Knobs(devices, 1, 1, 1, zero3=True)):
            try:
                plan = knobs.plan(graph, "fp32", replica)
                plan.check()
            except ChronotopeError:  # an op one replica's rows cannot run alone (as the
                # search does, data parallelism written into the plan instead)
                plan = knobs.plan(graph, "fp32") if not knobs.shard else None
            if plan is not None:
                rows.append(("mesh family", knobs.label, model.price(knobs).seconds, plan))
        options, _ = ilp_options(graph, devices, cluster, cluster.memory, 30.0)
        for seconds, option in options:
            if isinstance(option, Pipeline):
                _, plan, _ = _pipeline_plan(graph, option, None, _Clock())
                rows.append(("stage DP", option.label, seconds, plan))
            else:
                rows.append(("ILP", f"mesh {option[0].mesh}", seconds,
                             solution_plan(graph, option[0])))
        for family, label, seconds, plan in rows:
            step, _ = priced(plan, cluster)
            table.add_row(spec, family, label, f"{seconds * 1e3:.0f}", f"{step * 1e3:.0f}",
                          f"{seconds / step:.2f}")
            print(f"{spec} {family} {label}: {seconds / step:.2f}", file=sys.stderr,
                  flush=True)
    return table


def megatron_table() -> Table:
    """Megatron-LM's Table 1 rows against the search, priced by the same model."""
    from chronotope.search.knobs import Model, points

    table = Table(title="Megatron-LM's published plans (SC'21 Table 1: full recompute, "
                        "attention written out as it ran then) vs the search, bf16 on DGX "
                        "A100 nodes, by the search's model (ratio < 1: the search's is faster)")
    for col in ("model", "GPUs", "batch", "published (tp x pp x dp)", "its step s",
                "searched", "step s", "ratio", "TFLOP/s/GPU: published model / measured",
                "searched model"):
        table.add_column(col, justify="left" if col in ("published (tp x pp x dp)",
                                                          "searched") else "right")
    for size, heads, hidden, layers, tp, pp, gpus, batch, measured in MEGATRON:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = ct.capture(get_workload("gpt", device="meta", batch_size=batch,
                                            vocab_size=51200, block_size=2048, n_layer=layers,
                                            n_head=heads, d_model=hidden, flash=False),
                               check_up_to=0)
        cluster = cluster_for(gpus, "dgx-a100")
        model = Model(graph, cluster, "bf16")
        fits = [p for p in (model.price(k) for k in points(model, gpus, cluster.per_node,
                                                             replicas=True))
                if p.memory <= cluster.memory]
        published = [p for p in fits if (p.knobs.tp, p.knobs.pp) == (tp, pp) and
                     p.knobs.chunks == 1 and p.knobs.recompute == "full"
                     and not p.knobs.sequence and not p.knobs.shard and not p.knobs.zero_bubble]
        best = min(fits, key=lambda p: p.seconds, default=None)
        theirs = min(published, key=lambda p: p.seconds, default=None)
        # model FLOPs of a step with full recompute (Megatron's formula, SC'21 section 5.1)
        flops = 96 * batch * 2048 * layers * hidden ** 2 * (
            1 + 2048 / (6 * hidden) + 51200 / (16 * layers * hidden))

        def rate(p, flops=flops, gpus=gpus) -> str:
            return f"{flops / p.seconds / gpus / 1e12:.0f}" if p else "-"
        table.add_row(f"{size}B", f"{gpus:,}", f"{batch:,}",
                      theirs.knobs.label if theirs else f"tp {tp} x pp {pp}: does not fit",
                      f"{theirs.seconds:.2f}" if theirs else "-",
                      best.knobs.label if best else "nothing fits",
                      f"{best.seconds:.2f}" if best else "-",
                      f"{best.seconds / theirs.seconds:.3f}x" if best and theirs else "-",
                      f"{rate(theirs)} / {measured}", rate(best))
        print(f"{size}B done", file=sys.stderr, flush=True)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="gpt3-1.3b on one DGX A100 only")
    p.add_argument("--skip-scale", action="store_true", help="no 39B / 1,024-device rows")
    p.add_argument("--end-to-end", action="store_true",
                   help="also run each tiny model's searched plan on 2 and 4 processes")
    p.add_argument("--model", action="append", choices=list(MODELS),
                   help="quality rows of this model only (repeatable)")
    p.add_argument("--cluster", action="append", choices=CLUSTERS,
                   help="quality rows on this cluster only (repeatable)")
    p.add_argument("--knobs", action="store_true",
                   help="the mesh family's tables alone: scale and Megatron-LM's plans")
    p.add_argument("--agreement", action="store_true",
                   help="the search's models against the simulator alone")
    args = p.parse_args()
    if args.agreement:
        Console(width=220).print(agreement_table())
        return
    if args.knobs:
        Console(width=220).print(megatron_table())
        Console(width=220).print(knob_scale_table())
        return
    table = Table(title="plan search: time to decide, and simulated step vs the best "
                        "built-in policy that fits (ratio < 1 is better)")
    for col in ("case", "devices", "mesh (knobs)", "ILP (stage DP)", "D-Rec", "best built-in",
                "notes"):
        table.add_column(col, justify="right" if col == "devices" else "left")
    if not args.skip_scale:
        scale_rows(table, SCALE[:1] if args.quick else SCALE)
    quality_rows(table, args.model or (["gpt3-1.3b"] if args.quick else list(MODELS)),
                 args.cluster or (CLUSTERS[:1] if args.quick else CLUSTERS))
    Console(width=200).print(table)
    if args.end_to_end:
        Console(width=200).print(end_to_end(TINY[:1] if args.quick else TINY))


if __name__ == "__main__":
    main()
