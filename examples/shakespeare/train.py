"""Train the character-level GPT on Tiny Shakespeare with dp on 2 local processes.

    python examples/shakespeare/train.py --steps 300 --plot docs/shakespeare-loss.png

The Python API behind ``chronotope train``: capture the model, plan it, compile the
plan, and ``train`` it over the data; every step's record goes to ``--metrics``.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

import chronotope as ct
from chronotope.runtime.optim import Optim
from chronotope.runtime.train import mean_step_time, train

# isort: split
from data import decode, encode  # data.py and model.py sit next to this script
from model import char_gpt

DATA = f"{Path(__file__).resolve().with_name('data.py')}:batches"  # workers import it by path
VALIDATION = f"{Path(__file__).resolve().with_name('data.py')}:validation"  # held-out text


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: str, n: int, seed: int = 0) -> str:
    """``n`` characters sampled after ``prompt``. The model's forward returns the loss, so
    this runs its modules up to the logits itself."""
    g = torch.Generator().manual_seed(seed)
    idx = encode(prompt)[None]
    block = model.wpe.num_embeddings
    for _ in range(n):
        x = idx[:, -block:]
        h = model.wte(x) + model.wpe(torch.arange(x.shape[1]))
        for layer in model.h:
            h = layer(h)
        logits = model.lm_head(model.ln_f(h))[:, -1]
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return decode(idx[0])


def plot(records: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    window = 20
    mean = [statistics.fmean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, losses, color="tab:blue", alpha=0.35, linewidth=1, label="loss per step")
    ax.plot(steps, mean, color="tab:blue", linewidth=2, label=f"mean of {window} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title("char-level GPT on Tiny Shakespeare, dp on 2 gloo processes")
    ax.grid(alpha=0.3)
    evaluated = [r for r in records if "eval_loss" in r]
    ax.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], color="tab:red",
            marker="o", label="validation loss (held-out tenth)")
    lr = ax.twinx()
    lr.plot(steps, [r["lr"] for r in records], color="tab:orange", linewidth=1, label="lr")
    lr.set_ylabel("learning rate", color="tab:orange")
    lines = ax.get_legend_handles_labels()
    more = lr.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--devices", type=int, default=2, help="data-parallel processes")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=30, help="steps of linear warmup")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=50,
                        help="steps between validation losses")
    parser.add_argument("--metrics", default="metrics.jsonl", help="one JSON record a step")
    parser.add_argument("--plot", metavar="PNG", help="draw the loss curve here")
    args = parser.parse_args()

    workload = char_gpt(seed=args.seed)
    graph = ct.capture(workload.model, workload.inputs)
    program = ct.compile(ct.policies.mesh(graph, dp=args.devices))
    # AdamW as nanoGPT trains it: decay on matrices only, clipped gradients, warmup then
    # cosine down to a tenth of the peak rate.
    optim = Optim("adamw", lr=args.lr, weight_decay=0.1, clip=1.0, schedule="cosine",
                  warmup=args.warmup, min_lr=args.lr / 10)

    with open(args.metrics, "w") as metrics:
        def on_step(record: dict) -> None:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if record["step"] % 50 == 0 or record["step"] in (1, args.steps):
                evaluated = f"  validation {record['eval_loss']:.4f}" \
                    if "eval_loss" in record else ""
                print(f"step {record['step']:4d}  loss {record['loss']:.4f}{evaluated}  "
                      f"lr {record['lr']:.2e}  {record['step_s'] * 1e3:.0f} ms")

        result = train(program, workload, DATA, args.steps, optim, seed=args.seed,
                       on_step=on_step, eval_data=VALIDATION, eval_every=args.eval_every)

    print(f"final loss {result.losses[-1]:.4f}, validation loss "
          f"{result.records[-1]['eval_loss']:.4f}; {mean_step_time(result) * 1e3:.1f} ms a "
          f"step (mean after the first) on {args.devices} processes")
    if args.plot:
        plot(result.records, args.plot)
        print(f"loss curve: {args.plot}")

    workload.model.load_state_dict(result.params, strict=False)  # lm_head shares wte's weight
    print("sample:\n" + generate(workload.model, "ROMEO:\n", 200, seed=args.seed))


if __name__ == "__main__":
    main()
