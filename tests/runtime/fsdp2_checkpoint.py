"""Write an FSDP2 checkpoint as an FSDP2 script does (run in its own process: a one-rank
gloo group): ``fully_shard`` the built-in GPT, take one AdamW step, ``dcp.save`` the
state dicts torch's API gives, and ``torch.save`` the whole weights to compare with."""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from chronotope.models import get_workload

if __name__ == "__main__":
    out, port = sys.argv[1], sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    w = get_workload("gpt")
    model = fully_shard(w.model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*w.inputs).backward()
    opt.step()
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(out, "fsdp2"))
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.save(whole, os.path.join(out, "whole.pt"))
    dist.destroy_process_group()
