"""Two ParoShardedModules trained together (an encoder and a decoder, one loss) train like one process, and share
the engine's communicators and lanes: the second module, and a module built with the default groups again, make no
new process group.

Usage: engine_shared.py; 4 ranks as 2 groups of 2 (PARO_GROUP_SIZE=2).
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.distributed_c10d import _world

from paro_torch import ParoShardedModule
from paro_torch._groups import build_groups

STEPS, ACCUM, BATCH, DIM = 3, 2, 2, 8
TOL = 1e-5
PAIRS = [("IIG", "GGG"), ("NNG", "IIG"), ("GGG", "NNN")]  # (encoder, decoder)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def make(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, DIM), Block(), Block())


def loss_fn(enc: nn.Module, dec: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (dec(enc(x)) - x.flip(-1)).pow(2).mean()


def both(enc: dict[str, torch.Tensor], dec: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The two state dicts as one, under "enc." and "dec."."""
    return {f"enc.{k}": v for k, v in enc.items()} | {f"dec.{k}": v for k, v in dec.items()}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    data = [[torch.randn(world * BATCH, DIM, generator=g) for _ in range(ACCUM)] for _ in range(STEPS)]
    enc_ref, dec_ref = make(0), make(1)
    opt = torch.optim.AdamW([*enc_ref.parameters(), *dec_ref.parameters()], lr=1e-2)
    for micro in data:
        for x in micro:
            (loss_fn(enc_ref, dec_ref, x) / ACCUM).backward()
        opt.step()
        opt.zero_grad()
    want = both(enc_ref.state_dict(), dec_ref.state_dict())
    initial = both(make(0).state_dict(), make(1).state_dict())
    moved = max((want[k] - initial[k]).abs().max().item() for k in want)
    assert moved > 100 * TOL, moved  # the comparison can fail

    groups = build_groups()
    assert build_groups() is groups  # the default groups are made once
    for codes in PAIRS:
        kw = dict(process_groups=(groups.intra, groups.inter), wrap_policy={Block})
        enc = ParoShardedModule(make(0), codes[0], **kw)
        before = len(_world.pg_map)
        dec = ParoShardedModule(make(1), codes[1], **kw)
        assert len(_world.pg_map) == before, f"the second module made {len(_world.pg_map) - before} process groups"
        assert enc._engine.comms is dec._engine.comms  # one gather lane, one reduction lane
        opt = torch.optim.AdamW([*enc.parameters(), *dec.parameters()], lr=1e-2)
        for micro in data:
            for j, x in enumerate(micro):
                off = j < ACCUM - 1
                with (
                    enc.no_sync() if off else contextlib.nullcontext(),
                    dec.no_sync() if off else contextlib.nullcontext(),
                ):
                    (loss_fn(enc, dec, x[rank * BATCH : (rank + 1) * BATCH]) / ACCUM).backward()
            opt.step()
            opt.zero_grad()
        got = both(enc.full_state_dict(), dec.full_state_dict())
        assert got.keys() == want.keys(), (sorted(got), sorted(want))
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst < TOL, f"{codes}: parameters differ from one process by {worst:.3g}"
        if rank == 0:
            print(f"{codes}: max |diff| {worst:.2e} (moved {moved:.2e})", flush=True)
    before = len(_world.pg_map)
    ParoShardedModule(make(0), "IIG", group_size=2, wrap_policy={Block})
    assert len(_world.pg_map) == before, "a module with the default groups made new process groups"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
