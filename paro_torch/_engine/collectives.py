"""The engine's collectives on flat buffers, and the ledger of what they cost this rank."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Ledger:
    """What the collectives one communication lane ran on a buffer cost this rank.

    ``sent``: bytes per level ("intra", "inter") by the ring formula of each collective (nominal, as the cost model
    counts them). ``unpacked``: bytes copied out of gathered buffers into the parameters' natural storage (the cost
    model's ``unpacked_bytes``). ``seconds``: wall seconds per "<collective> <level>" from each call to its return,
    and of the copy-outs ("unpack local"), on the CPU only, where a Gloo call returns when its work is done (waiting
    for late peers included); on CUDA calls return once queued, and nothing is recorded.
    """

    sent: dict[str, int] = field(default_factory=lambda: {"intra": 0, "inter": 0})
    unpacked: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def call(self, op: str, level: str, pg: dist.ProcessGroup, whole: torch.Tensor, passes: int = 1) -> Iterator[None]:
        """Records the enclosed ring collective ``op`` over ``pg`` on ``whole`` (the whole buffer).

        The bytes it sends from this rank, (k - 1)/k of ``whole`` per pass, and on the CPU its seconds.
        """
        start = time.perf_counter()
        yield
        if whole.device.type == "cpu":
            key = f"{op} {level}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
        k = dist.get_world_size(pg)
        self.sent[level] += passes * (k - 1) * (whole.numel() * whole.element_size() // k)

    @contextlib.contextmanager
    def unpack(self, whole: torch.Tensor, grown: float = 0.0) -> Iterator[None]:
        """Records the enclosed copy-out of the gathered buffer ``whole`` into natural storage.

        ``grown``: the seconds the storage took to grow, before the gather (counted with the copy).
        """
        start = time.perf_counter() - grown
        yield
        if whole.device.type == "cpu":
            self.seconds["unpack local"] = self.seconds.get("unpack local", 0.0) + time.perf_counter() - start
        self.unpacked += whole.numel() * whole.element_size()

    def reset(self) -> None:
        self.sent.update(intra=0, inter=0)
        self.unpacked = 0
        self.seconds.clear()


def reduce_scatter(x: torch.Tensor, pg: dist.ProcessGroup | None, ledger: Ledger, level: str) -> torch.Tensor:
    """This rank's block of the sum over ``pg`` of ``x`` (``x`` itself where there is no group)."""
    if pg is None:
        return x
    k = dist.get_world_size(pg)
    with ledger.call("reduce_scatter", level, pg, x):
        if x.device.type == "cpu" and dist.get_backend(pg) == "gloo":
            # Gloo's reduce_scatter runs a whole all_reduce (twice the bytes of a ring reduce-scatter): exchange the
            # shards instead and add up this rank's here, in rank order, as the cost model counts it
            parts = torch.empty_like(x)
            dist.all_to_all_single(parts, x, group=pg)
            out = parts.view(k, -1).sum(0)
        else:
            out = torch.empty(x.numel() // k, dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(out, x, group=pg)
    return out


def all_gather(out: torch.Tensor, x: torch.Tensor, pg: dist.ProcessGroup | None, ledger: Ledger, level: str) -> None:
    """``out`` ← the blocks ``x`` of every rank of ``pg`` (a copy of ``x`` where there is no group)."""
    out, x = out.detach(), x.detach()  # collectives write in place; autograd must not see them
    if pg is None:
        out.copy_(x)
        return
    shares = x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    with ledger.call("all_gather", level, pg, out):
        dist.all_gather_into_tensor(out, x.clone() if shares else x, group=pg)


def all_reduce(x: torch.Tensor, pg: dist.ProcessGroup, ledger: Ledger, level: str) -> torch.Tensor:
    """The sum of ``x`` over ``pg``, in a new tensor (two ring passes)."""
    x = x.clone()
    with ledger.call("all_reduce", level, pg, x, passes=2):
        dist.all_reduce(x, group=pg)
    return x
