"""With p = G, activation checkpointing does not unshard more units during backward than training without it.

Usage: engine_unsharded.py (any world size). Six blocks, each its own unit; the peak number of units holding
gathered parameters is the root, the unit computing and the one prefetched: 3, in forward and in backward.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import paro_torch
from paro_torch import ParoShardedModule

BLOCKS, DIM = 6, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.reentrant = reentrant  # None: no checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x) if self.reentrant is None else checkpoint(b, x, use_reentrant=self.reentrant)
        return x.sum()


def peak(reentrant: bool | None, early_stop: bool) -> dict[str, int]:
    torch.manual_seed(0)
    model = ParoShardedModule(Stack(reentrant), "GGG", wrap_policy={Block})
    with set_checkpoint_early_stop(early_stop):
        for _ in range(2):
            model(torch.randn(4, DIM)).backward()
    return model.peak_unsharded


def main() -> None:
    dist.init_process_group("gloo")
    plain = peak(None, True)
    # the root, the unit computing and the ones gathered ahead by the cost model's rule (IssuePolicy)
    held = 2 + paro_torch._C.Strategy("GGG").gather_ahead
    assert plain == {"forward": held, "backward": held}, plain
    for reentrant, early_stop in [(False, True), (False, False), (True, True)]:
        got = peak(reentrant, early_stop)
        assert got["backward"] <= plain["backward"], (reentrant, early_stop, got, plain)
        if dist.get_rank() == 0:
            print(f"reentrant={reentrant} early_stop={early_stop}: peak unsharded {got} (plain {plain})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
