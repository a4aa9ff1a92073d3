"""Under torchrun, init_process_group("paro") works without importing paro_torch (entry point)."""

import sys

import torch
import torch.distributed as dist

for spec in ("paro", "cpu:paro,cuda:paro"):
    dist.init_process_group(spec)
    assert "paro_torch" in sys.modules  # loaded by torch through the entry point, not by us
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    n = dist.get_world_size()
    assert torch.equal(t, torch.full((3,), n * (n + 1) / 2)), t
    dist.destroy_process_group()
print("entry point OK")
