"""Under torchrun, init_process_group("paro") works without importing paro_torch (entry point)."""

import sys

import torch
import torch.distributed as dist

# torch before 2.14 loads no torch.distributed.backends entry points: there the backend is registered by importing
ENTRY_POINTS = hasattr(dist.Backend, "_ensure_backend_registered")
if not ENTRY_POINTS:
    import paro_torch  # noqa: F401

for spec in ("paro", "cpu:paro,cuda:paro"):
    dist.init_process_group(spec)
    assert "paro_torch" in sys.modules  # loaded by torch through the entry point, not by us (from torch 2.14)
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    n = dist.get_world_size()
    assert torch.equal(t, torch.full((3,), n * (n + 1) / 2)), t
    dist.destroy_process_group()
print("entry point OK")
