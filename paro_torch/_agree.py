"""Errors that every rank raises together, so that no rank waits in a collective for one that failed."""

from __future__ import annotations

import torch
import torch.distributed as dist


def raise_together(
    error: BaseException | None,
    what: str,
    extra: torch.Tensor | None = None,
    error_type: type[Exception] = RuntimeError,
) -> torch.Tensor:
    """One all-gather of "did I fail" (and ``extra``, int64, the same length on every rank) over the world.

    The failed ranks raise their own error, the others an ``error_type`` naming them; otherwise returns every rank's
    ``extra`` as a (world, len) tensor.
    """
    world = dist.get_world_size()
    tail = extra if extra is not None else torch.zeros(0, dtype=torch.int64)
    mine = torch.cat([torch.tensor([int(error is not None)]), tail.to(torch.int64)])
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64)
    dist.all_gather_into_tensor(everyone, mine)
    everyone = everyone.view(world, -1)
    if error is not None:
        raise error
    failed = [r for r in range(world) if everyone[r, 0] != 0]
    if failed:
        raise error_type(f"{what} failed on ranks {failed} (see their errors); fix it there and run again")
    return everyone[:, 1:]
