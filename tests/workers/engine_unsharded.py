"""With p = G, activation checkpointing and frozen parameters do not unshard more units during backward.

Usage: engine_unsharded.py (any world size). Six blocks, each its own unit; the peak number of units holding
gathered parameters is the root, the unit computing and the one prefetched: 3, in forward and in backward; the
same, give or take one unit, with frozen weights (LoRA-like: a frozen and a trainable buffer per unit), with every
other block frozen whole, and with blocks that modify their input in place (frozen parameters have no gradient
hook: they are freed when the unit's input gradients are complete).
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

        self.inplace = False  # modifies its input in place first (ReLU(inplace=True) on it, say)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            x = x.mul_(1.0)
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


def peak(reentrant: bool | None, early_stop: bool, frozen: str = "") -> dict[str, int]:
    torch.manual_seed(0)
    stack = Stack(reentrant)
    for i, b in enumerate(stack.blocks):
        b.inplace = frozen == "inplace"
        if frozen in ("weights", "inplace"):
            b.fc.weight.requires_grad_(False)
        elif frozen == "blocks" and i % 2:
            b.requires_grad_(False)
    model = ParoShardedModule(stack, "GGG", wrap_policy={Block})
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
    for frozen in ("weights", "blocks", "inplace"):
        # a unit's frozen part waits for its input's gradient, which the unit before it is also hooked on: at
        # most one unit more than with trainable parameters alone (before, every unit stayed gathered)
        got = peak(None, True, frozen)
        assert got["forward"] == plain["forward"] and got["backward"] <= plain["backward"] + 1, (frozen, got, plain)
    for reentrant, early_stop in [(False, True), (False, False), (True, True)]:
        for frozen in ("", "weights"):
            got = peak(reentrant, early_stop, frozen)
            assert got["backward"] <= plain["backward"] + bool(frozen), (reentrant, early_stop, frozen, got, plain)
            if dist.get_rank() == 0:
                print(f"reentrant={reentrant} early_stop={early_stop} frozen={frozen or 'none'}: peak unsharded "
                      f"{got} (plain {plain})", flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
