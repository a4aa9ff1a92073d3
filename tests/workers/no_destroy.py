"""A user script that never calls destroy_process_group: HSDP (FSDP2) on ``paro``, then async collectives whose
tensors are dropped before the interpreter exits. It must exit 0 (clean exits)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import paro_torch

dist.init_process_group("paro")
world = dist.get_world_size()
group = paro_torch._backend.resolve_group_size(world)
mesh = init_device_mesh("cpu", (world // group, group), mesh_dim_names=("dp_replicate", "dp_shard"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
works = [dist.all_reduce(torch.ones(64), async_op=True) for _ in range(4)]
works[-1].wait()
print(f"rank {dist.get_rank()}: done without destroy_process_group")
