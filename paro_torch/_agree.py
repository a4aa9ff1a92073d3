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
    device = collective_device()
    tail = extra if extra is not None else torch.zeros(0, dtype=torch.int64)
    mine = torch.cat([torch.tensor([int(error is not None)]), tail.to(torch.int64)]).to(device)
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(everyone, mine)
    everyone = everyone.view(world, -1).cpu()
    if error is not None:
        raise error
    failed = [r for r in range(world) if everyone[r, 0] != 0]
    if failed:
        raise error_type(f"{what} failed on ranks {failed} (see their errors); fix it there and run again")
    return everyone[:, 1:]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s backend (default: the default group's) runs collectives: the CPU where it can, else CUDA.

    A default group made with ``init_process_group("nccl")`` has no CPU backend: small agreements then run on this
    rank's current GPU (one copy back to the CPU per agreement).
    """
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl" or backend.startswith("cuda:nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
