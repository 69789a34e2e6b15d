"""Megatron for the built-in GPT with each MLP's bias and GELU run as one compiled function.

Two ways to get the column projection's bias out of the matmul, so that it can fuse
with the GELU after it: replace the module with one written that way (the first
half of the blocks), or split it in the captured graph (``decompose``, the rest).
Either way ``fuse`` then runs the add and the GELU as one ``torch.compile``d function
in each rank's generated code.

    chronotope run gpt --schedule docs/schedules/gpt_fused.py:fused --devices 2 --check
"""

import torch.nn.functional as F
from gpt_megatron import megatron
from torch import nn


def bias_gelu(y, bias):
    return F.gelu(y + bias)


class BiasGeluMLP(nn.Module):
    """GPT's MLP, its first bias added inside ``bias_gelu``; the weights are the old MLP's."""

    def __init__(self, old):
        super().__init__()
        self.c_fc, self.c_proj = old.c_fc, old.c_proj

    def forward(self, x):
        return self.c_proj(bias_gelu(F.linear(x, self.c_fc.weight), self.c_fc.bias))


def fused(sch, compiler="torch.compile"):
    blocks = len(sch["h"].module)
    for i in range(blocks):  # modules are replaced first: the model is captured again
        if i < blocks // 2:
            sch[f"h.{i}.mlp"].replace(BiasGeluMLP(sch[f"h.{i}.mlp"].module))
    for i in range(blocks):
        mlp = sch[f"h.{i}.mlp"]
        if i >= blocks // 2:
            mlp["c_fc"].decompose()
        mlp.fuse(mlp.find(["add", "gelu"]), compiler=compiler)
    megatron(sch)


def fused_quick(sch):
    """The same with ``aot_eager``: the graphs traced and split for autograd as inductor gets
    them, run without generating kernels (quick to start on a CPU; what the tests run)."""
    fused(sch, compiler="aot_eager")
