"""What a rank's engine sent, copied and holds: the figures the cost model predicts, measured."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from paro_torch._engine.collectives import Ledger
from paro_torch._engine.flat_buffer import FlatBuffer


def _ledgers(buffers: list[FlatBuffer]) -> Iterator[Ledger]:
    for b in buffers:
        yield from (b.ledger, b.rledger)


def comm_bytes(buffers: list[FlatBuffer]) -> dict[str, int]:
    """Bytes sent per level by the ring formula, summed over the buffers' ledgers."""
    out = {"intra": 0, "inter": 0}
    for ledger in _ledgers(buffers):
        for level in out:
            out[level] += ledger.sent[level]
    return out


def unpacked_bytes(buffers: list[FlatBuffer]) -> int:
    return sum(ledger.unpacked for ledger in _ledgers(buffers))


def comm_seconds(buffers: list[FlatBuffer]) -> dict[str, float]:
    out: dict[str, float] = {}
    for ledger in _ledgers(buffers):
        for key, seconds in ledger.seconds.items():
            out[key] = out.get(key, 0.0) + seconds
    return out


def reset(buffers: list[FlatBuffer]) -> None:
    for ledger in _ledgers(buffers):
        ledger.reset()


def memory_stats(buffers: list[FlatBuffer], optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes held persistently for parameters, gradient accumulators and optimizer states (with masters)."""
    params = sum(b.p_shard.numel() * b.p_shard.element_size() for b in buffers)
    grads = sum(b.g_acc.numel() * b.g_acc.element_size() for b in buffers if b.g_acc is not None)
    optim = sum(b.master_bytes() for b in buffers)
    if optimizer is not None:
        for b in buffers:
            for p in b.params if b.trainable else []:
                for name, v in optimizer.state.get(p, {}).items():
                    local = v.to_local() if isinstance(v, DTensor) else v
                    if torch.is_tensor(local) and name != "step":
                        optim += local.numel() * local.element_size()
    return {"params": params, "grads": grads, "optimizer_states": optim}
