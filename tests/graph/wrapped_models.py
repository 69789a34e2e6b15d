"""Capture a model another parallelism wrapped (run in its own process: it starts a
one-rank gloo group, which the test process must not keep): prints each refusal."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import chronotope as ct


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    wrapped = {"parallelize_module": parallelize_module(model(), mesh, {"0": ColwiseParallel()}),
               "fully_shard": fully_shard(model(), mesh=mesh),
               "DDP": nn.parallel.DistributedDataParallel(model())}
    for how, m in wrapped.items():
        try:
            ct.capture(m, (torch.randn(2, 4),), loss_fn=lambda out: out.sum())
            print(f"{how}: captured")
        except ct.CaptureError as e:
            print(f"{how}: {e}")
    dist.destroy_process_group()
