"""Expert parallelism: a Mixtral-shaped model's step time, memory and weights per rank under
data parallelism and with its experts shared out over 2 and 4 of the ranks, and with
tensor parallelism (inside the experts too).

    python benchmarks/experts.py [--devices 4] [--experts 8] [--d-model 128] [--steps 4]
                                 [--only time|search|lanes|latent]

The model is transformers' MixtralForCausalLM from a small config (``--experts`` experts,
top 2, 2 layers, batch 8 x 128 tokens, the router's balancing loss on), captured with its
experts as one op each (``graph/experts.py``). Each ep runs twice: its tokens dispatched
and combined by all-to-alls of the rows routed to each rank's experts (what chronotope
compiles), and, for comparison, sent whole to every rank of the group (the plan without
its exchanges, ``plan.exchanges`` cleared). Time: the median step of ``--devices`` gloo
processes, slowest rank, as a ratio to data parallelism in the same run. Memory: every
rank a thread (``PeakMemory``): the most a rank's step makes, and the bytes of the
weights it keeps (the experts' share falls as 1 / ep). Traffic: the MiB a step moves
between ranks, all ranks together (the routed rows as they went, counted in the threads'
run; everything else as compiled).

Lanes: tensor parallelism inside the experts, compiled and simulated on 16 H100s (two
nodes): a Mixtral-shaped model (d_model 2,048, 8 experts, top 2, 2 layers, on the meta
device) on 16 x 1,024 tokens, under dp x tp x ep meshes: the bytes a step moves, all ranks
together (and of them the exchanges' routed rows, as a spreading router sends them), and
the simulated step. Each lane combines its part of the experts' outputs from its own lane
of each member and the lanes sum theirs in one all-reduce, so a routed row travels once
per lane (sent to every lane, ``dp 4 x tp 4 x ep 4`` moved 26.0 GiB and took 26.4 ms).

Latent: a DeepSeek-V3-shaped model (its widths, 2 layers, 8 experts, top 2, on the meta
device) on 8 x 4,096 tokens, 8 simulated H100s, under tp 8 and dp 2 x tp 4 x ep 2: the
simulated step, the activations the plan holds on the fullest device, the bytes a step
moves. Its low-rank down-projections stay whole and its up-projections are cut by heads
(``tensor_parallel_dims``); cut by column at the down-projections, attention ran whole on
every device: tp 8 took 1,451 ms with 207 GiB of activations per device, dp 2 x tp 4 x ep
2 1,022 ms with 103.

Search: Mixtral 8x7B (transformers' default config, on the meta device) at 64 samples of
4,096 tokens on 64 H100s in bf16: the mesh search's plan next to dp x tp x ep grids, each
priced by the search's model (step seconds, GiB on the fullest device, fits in 80 GiB).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch
import transformers as tf
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chronotope as ct  # noqa: E402
from chronotope.compile.program import Exchange  # noqa: E402
from chronotope.policies import mesh  # noqa: E402
from chronotope.runtime.launch import launch  # noqa: E402
from chronotope.runtime.local import Optim, rank_specs, run_in_threads  # noqa: E402
from chronotope.runtime.transport import ThreadTransport  # noqa: E402
from chronotope.workload import Workload  # noqa: E402


def workload(experts: int, d_model: int) -> Workload:
    config = tf.MixtralConfig(vocab_size=512, hidden_size=d_model, intermediate_size=2 * d_model,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              num_local_experts=experts, num_experts_per_tok=2,
                              max_position_embeddings=256, use_cache=False,
                              output_router_logits=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(config).train()
    ids = torch.randint(3, 512, (8, 128), generator=torch.Generator().manual_seed(0))
    return Workload(model, (), {"input_ids": ids, "labels": ids}, name="mixtral")


def search_table() -> Table:
    from chronotope.cost.network import cluster_for
    from chronotope.models.hf import hf_causal_lm
    from chronotope.search import search
    from chronotope.search.knobs import Knobs, Model

    w = hf_causal_lm("hf:mixtral", device="meta", batch_size=64, seq_len=4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    cluster = cluster_for(64, "h100-sxm")
    model = Model(graph, cluster, "bf16")
    found = search(graph, 64, cluster, method="mesh", dtype="bf16", simulate=False)
    table = Table(title=f"Mixtral 8x7B ({graph.num_params / 1e9:.1f}B), 64 x 4,096 tokens, "
                        "64 H100s, bf16: the search's model")
    for col in ("plan", "step s", "GiB", "fits"):
        table.add_column(col, justify="right" if col != "plan" else "left")
    table.add_row(f"searched: {found.mesh}", f"{found.predicted_step_s:.2f}",
                  f"{max(found.peak_memory_bytes) / 2**30:.1f}", "yes")
    for dp, tp, ep in ((64, 1, 1), (8, 8, 1), (64, 1, 8), (8, 8, 8), (16, 4, 8), (32, 2, 8)):
        knobs = Knobs(dp, tp, 1, 64 // dp, recompute="full", ep=ep)
        priced = model.price(knobs)
        table.add_row(knobs.label, f"{priced.seconds:.2f}", f"{priced.memory / 2**30:.1f}",
                      "yes" if priced.memory <= cluster.memory else "no")
    return table


def _on_meta(model_class: type, config: object, batch: tuple[int, int], name: str) -> ct.Graph:
    """A causal language model of ``config`` built on the meta device (no weights made),
    captured on a batch of that many token ids, labels its inputs."""
    with torch.device("meta"):
        model = model_class(config).train()
    ids = torch.randint(3, config.vocab_size, batch)  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(Workload(model, (), {"input_ids": ids, "labels": ids}, name=name))


def _label(dp: int, tp: int, ep: int) -> str:
    """A mesh as its sizes above 1: ``dp 4 x tp 4 x ep 4``."""
    return " x ".join(f"{k} {v}" for k, v in (("dp", dp), ("tp", tp), ("ep", ep)) if v > 1)


def lanes_table() -> Table:
    from chronotope.compile.simulate import simulate
    from chronotope.cost.network import cluster_for

    config = tf.MixtralConfig(vocab_size=512, hidden_size=2048, intermediate_size=4096,
                              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                              num_local_experts=8, num_experts_per_tok=2,
                              max_position_embeddings=1024, use_cache=False,
                              attn_implementation="sdpa")
    graph = _on_meta(tf.MixtralForCausalLM, config, (16, 1024), "mixtral")
    cluster = cluster_for(16, "h100-sxm")
    table = Table(title="Mixtral-shaped (d_model 2,048, 8 experts, top 2, 2 layers), 16 x 1,024 "
                        "tokens, 16 simulated H100s: experts under tensor parallelism")
    for col in ("plan", "GiB moved / step", "of it routed rows", "step ms"):
        table.add_column(col, justify="right" if col != "plan" else "left")
    for dp, tp, ep in ((16, 1, 8), (8, 2, 8), (4, 4, 4), (4, 4, 1)):
        program = ct.compile(mesh(graph, dp=dp, tp=tp, ep=ep), cluster=cluster)
        traffic = [program.traffic(r) for r in range(program.ndevices)]
        table.add_row(_label(dp, tp, ep), f"{sum(sum(t.values()) for t in traffic) / 2**30:.2f}",
                      f"{sum(t['all_to_all'] for t in traffic) / 2**30:.2f}",
                      f"{simulate(program, cluster).step_time * 1e3:.2f}")
    return table


def latent_table() -> Table:
    from chronotope.compile.simulate import simulate
    from chronotope.cost.network import cluster_for

    config = tf.DeepseekV3Config(vocab_size=4096, hidden_size=7168, intermediate_size=18432,
                                 moe_intermediate_size=2048, num_hidden_layers=2,
                                 num_attention_heads=128, num_key_value_heads=128,
                                 n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                                 n_group=2, topk_group=1, first_k_dense_replace=1,
                                 kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                 qk_nope_head_dim=128, v_head_dim=128,
                                 max_position_embeddings=4096, use_cache=False,
                                 attn_implementation="sdpa")
    graph = _on_meta(tf.DeepseekV3ForCausalLM, config, (8, 4096), "deepseek-v3")
    cluster = cluster_for(8, "h100-sxm")
    table = Table(title="DeepSeek-V3-shaped (2 layers, 8 experts, top 2), 8 x 4,096 tokens, "
                        "8 simulated H100s: latent attention under tensor parallelism")
    for col in ("plan", "step ms", "activations GiB / device", "GiB moved / step"):
        table.add_column(col, justify="right" if col != "plan" else "left")
    for dp, tp, ep in ((1, 8, 1), (2, 4, 2)):
        plan = mesh(graph, dp=dp, tp=tp, ep=ep)
        program = ct.compile(plan, cluster=cluster)
        held = max(m.activations for m in plan.check().memory.values())
        moved = sum(sum(program.traffic(r).values()) for r in range(program.ndevices))
        table.add_row(_label(dp, tp, ep), f"{simulate(program, cluster).step_time * 1e3:.0f}",
                      f"{held / 2**30:.1f}", f"{moved / 2**30:.0f}")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--only", choices=("time", "search", "lanes", "latent"))
    args = p.parse_args()
    if args.only in (None, "lanes"):
        Console(width=120).print(lanes_table())
    if args.only in (None, "latent"):
        Console(width=120).print(latent_table())
    if args.only in (None, "search"):
        Console(width=120).print(search_table())
    if args.only in ("search", "lanes", "latent"):
        return
    w = workload(args.experts, args.d_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(w)
    table = Table(title=f"Mixtral-shaped, {args.experts} experts (top 2), d_model "
                        f"{args.d_model}, 2 layers, batch 8 x 128, on {args.devices} ranks")
    for col in ("plan", "tokens", "step ms", "/ dp", "peak MiB", "traffic MiB",
                "weights MiB / rank"):
        table.add_column(col, justify="right" if col not in ("plan", "tokens") else "left")
    base = None
    n = args.devices
    shapes = [(n // tp, tp, ep) for tp in (1, 2) if n % tp == 0 for ep in (1, 2, 4)
              if (n // tp) % ep == 0 and args.experts % ep == 0]
    for dp, tp, ep in shapes:
        for routed in (True, False) if ep > 1 and tp == 1 else (True,):
            plan = mesh(graph, dp=dp, tp=tp, ep=ep)
            if not routed:
                plan.exchanges = {}
            program = ct.compile(plan)
            results = launch(rank_specs(program, w), args.steps, Optim("sgd", 0.1), timeout=600)
            step = statistics.median([max(ts) for ts in zip(*(r[2] for r in results))][1:])
            base = base or step
            with Moved() as moved:
                run = run_in_threads(program, w, 1, Optim("sgd", 0.1), measure_memory=True)
            traffic = sum(sum(program.traffic(r).values()) for r in range(program.ndevices))
            traffic += moved.bytes - _expected(program)
            stored = plan.check().memory
            label = " x ".join([f"dp {dp}"] + [f"{k} {v}" for k, v in (("tp", tp), ("ep", ep))
                                               if v > 1])
            table.add_row(label, "" if ep == 1 else "all-to-all" if routed else "whole",
                          f"{step * 1e3:.1f}", f"{step / base:.2f}",
                          f"{max(run.peak_memory) / 2**20:.1f}", f"{traffic / 2**20:.2f}",
                          f"{max(m.params for m in stored.values()) / 2**20:.2f}")
    Console(width=120).print(table)


class Moved:
    """Counts the bytes the threads' exchanges of routed rows send to other ranks."""

    def __enter__(self) -> Moved:
        self.bytes = 0
        self.original = ThreadTransport.all_to_all_rows

        def counted(transport, blocks, ranks, rank, async_op=False, counts=None):
            self.bytes += sum(b.numel() * b.element_size() for r, b in zip(ranks, blocks)
                              if r != rank)
            return self.original(transport, blocks, ranks, rank, async_op, counts)

        ThreadTransport.all_to_all_rows = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *_: object) -> None:
        ThreadTransport.all_to_all_rows = self.original  # type: ignore[method-assign]


def _expected(program) -> float:
    """The bytes ``Program.traffic`` counts for the exchanges: a spreading router's."""
    return sum(ins.expected_bytes() for code in program.ranks for ins in code
               if isinstance(ins, Exchange))


if __name__ == "__main__":
    main()
