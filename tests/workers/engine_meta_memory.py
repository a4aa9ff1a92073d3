"""Wrapping a model built on the meta device: each rank's peak memory is its shards plus about two units.

Measured as the growth of the peak resident set (VmHWM, reset through /proc/self/clear_refs) while the model is
built and wrapped, against the same model built on the CPU first (the whole model on every rank). Run with
MALLOC_MMAP_THRESHOLD_ set, so freed buffers leave the resident set.
"""

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from paro_torch import ParoShardedModule

WIDTH, BLOCKS = 1024, 48  # 1M parameters (4 MB) per block, 192 MB in all
MB = 1 << 20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


def build(device: str) -> nn.Module:
    with torch.device(device):
        return nn.Sequential(*[Block() for _ in range(BLOCKS)])


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_growth(device: str, code: str) -> tuple[int, int]:
    """Peak resident bytes above the start while the model is built (on ``device``) and wrapped, and the bytes
    the engine holds afterwards (parameter shards, gradient accumulators, masters)."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    start = status("VmRSS")
    model = ParoShardedModule(build(device), code, wrap_policy={Block})
    growth = status("VmHWM") - start
    held = model.memory_stats()
    x = torch.randn(2, WIDTH)
    model(x).sum().backward()  # the wrapped model works
    del model
    gc.collect()  # freed before the next measurement starts
    return growth, sum(held.values())  # without an optimizer: separate float32 masters only


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    codes = sys.argv[1].split(",")
    ParoShardedModule(nn.Linear(4, 4), codes[0])  # warm-up: the engine's groups and meshes are made once
    unit = WIDTH * WIDTH * 4
    for code in codes:  # each from a reset peak
        meta, shards = peak_growth("meta", code)
        whole, _ = peak_growth("cpu", code)
        sizes = f"shards {shards / MB:.1f} MB, one unit {unit / MB:.1f} MB, the model {BLOCKS * unit / MB:.1f} MB"
        print(f"rank {rank} {code}: peak {meta / MB:.1f} MB from meta, {whole / MB:.1f} MB from a CPU model; {sizes}")
        assert whole >= BLOCKS * unit, "the CPU-built model must show in the measurement"
        # transient, one unit at a time: its materialised parameters and the staging copy of the broadcast from
        # rank 0 (then only this rank's blocks are copied out), with a unit's worth of allocator slack
        assert meta <= shards + 3 * unit, f"{code}: wrapping a meta model peaked at {meta / MB:.1f} MB"
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
