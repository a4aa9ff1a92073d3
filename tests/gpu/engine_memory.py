"""The engine's memory on one rank (``--backend nccl --device cuda|cpu``): a prefetching ParoShardedModule (GGG) holds
about two units' whole parameters at a time, however far the CPU runs ahead of the GPU.

A stack of 8 equal units (Linear 1024 x 1024, 4 MiB each in float32) on 4 ranks. After two warm-up steps, one
forward and backward: on CUDA, the peak of allocated memory above what was allocated before the forward, in units,
must stay within 2 gathered units + 2 unreduced gradients + 1 of slack (activations are ~0.03 units); everywhere,
the engine's own count of units holding whole parameters at once must be at most 2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from _common import Checks, parse_args

UNITS, DIM, BATCH = 8, 1024, 8
BOUND_UNITS = 5.0


def main() -> None:
    args = parse_args()
    from paro_torch import ParoShardedModule  # the checkout's (see _common)

    cuda = args.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    checks = Checks(dist.get_rank())
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Linear(DIM, DIM, bias=False) for _ in range(UNITS)])
    model = ParoShardedModule(blocks.to(dev), "GGG", wrap_policy={nn.Linear}, device=dev, group_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, DIM, device=dev)
    unit_bytes = DIM * DIM * 4

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    model.peak_unsharded = {"forward": 0, "backward": 0}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    model(x).square().mean().backward()

    def device_peak() -> str | None:
        if not cuda:
            return "skipped: allocator statistics need a GPU"
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated(dev) - before) / unit_bytes
        print(f"rank {dist.get_rank()}: peak {peak:.2f} units above the shards ({unit_bytes} bytes each)", flush=True)
        assert peak <= BOUND_UNITS, f"peak {peak:.2f} units > {BOUND_UNITS}"
        return None

    def unsharded_count() -> None:
        assert max(model.peak_unsharded.values()) <= 2, model.peak_unsharded

    checks.run("engine peak memory (allocator)", device_peak)
    checks.run("engine units unsharded at once", unsharded_count)
    checks.finish()


if __name__ == "__main__":
    main()
