"""One unit's parameters in a padded flat buffer and its p, g and os shards (nested layout, paro-spec §3).

Rank (k, r) holds I-shard r of the padded buffer and, inside it, G-shard block r·g + k, so going N→I is an
intra-group collective and I→G an inter-group one among ranks of equal local rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from paro_torch import _C
from paro_torch._groups import ParoGroups

N, I, G = "N", "I", "G"  # noqa: E741  (the paper's granularity letters)


@dataclass
class ParamSlot:
    """Where one original parameter lives in a flat buffer."""

    module: nn.Module
    name: str
    fqn: str
    shape: torch.Size
    offset: int
    numel: int
    aliases: list[tuple[nn.Module, str, str]] = field(default_factory=list)
    """Other (module, attribute, fqn) that share the parameter (tied weights)."""


Sent = dict[str, int]
"""Bytes this rank sent per level ("intra", "inter") by the ring formula of each collective it ran (nominal)."""


def _ring(sent: Sent, level: str, pg: dist.ProcessGroup, x: torch.Tensor, times: int = 1) -> None:
    """Counts what a ring collective on ``x`` (the whole buffer) sends from this rank: (k - 1)/k of it, per pass."""
    k = dist.get_world_size(pg)
    sent[level] += times * (k - 1) * (x.numel() * x.element_size() // k)


def _reduce_scatter(x: torch.Tensor, pg: dist.ProcessGroup | None, sent: Sent, level: str) -> torch.Tensor:
    if pg is None:
        return x
    out = torch.empty(x.numel() // dist.get_world_size(pg), dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x, group=pg)
    _ring(sent, level, pg, x)
    return out


def _all_gather(out: torch.Tensor, x: torch.Tensor, pg: dist.ProcessGroup | None, sent: Sent, level: str) -> None:
    out, x = out.detach(), x.detach()  # collectives write in place; autograd must not see them
    if pg is None:
        out.copy_(x)
        return
    shares = x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    dist.all_gather_into_tensor(out, x.clone() if shares else x, group=pg)
    _ring(sent, level, pg, out)


class FlatBuffer:
    """The trainable (or the frozen) parameters of one unit, packed, padded to a multiple of n and sharded."""

    def __init__(
        self,
        slots: list[ParamSlot],
        values: list[torch.Tensor],
        strategy: _C.Strategy,
        groups: ParoGroups,
        trainable: bool,
        param_dtype: torch.dtype,
        on_grad_ready: Callable[[FlatBuffer, torch.Tensor], None] | None = None,
        reduce_groups: ParoGroups | None = None,
    ) -> None:
        self.slots = slots
        self.sent: Sent = {"intra": 0, "inter": 0}
        """Nominal bytes of gathers and t_syncp (the gather thread)."""
        self.rsent: Sent = {"intra": 0, "inter": 0}
        """Nominal bytes of reductions and t_syncg (the reduction thread)."""
        self.rgroups = reduce_groups or groups
        """The groups gradients are reduced on: a twin of ``groups`` when reductions run on their own thread."""
        self.on_grad_ready = on_grad_ready or (lambda b, grad: b.reduce(grad))
        self.strategy = strategy
        self.groups = groups
        self.trainable = trainable
        self.param_dtype = param_dtype
        sizes = [s.numel for s in slots]
        assert [s.offset for s in slots] == list(itertools.accumulate(sizes, initial=0))[:-1], "slots not contiguous"
        self.numel = sum(sizes)
        self.padded = _C.padded_numel(self.numel, groups.world)
        self._split_sizes = [*sizes, self.padded - self.numel]  # the parameters, then the padding
        full = torch.zeros(self.padded, dtype=param_dtype)
        master_full = torch.zeros(self.padded, dtype=torch.float32) if trainable else None
        for s, v in zip(slots, values, strict=True):
            full[s.offset : s.offset + s.numel] = v.detach().reshape(-1)
            if master_full is not None:
                master_full[s.offset : s.offset + s.numel] = v.detach().reshape(-1).float()
        self.p_lo, self.p_hi = self.range(strategy.p)
        # p-shard: the persistent parameter storage (the whole buffer when p = N)
        self.p_shard = full if strategy.p == N else full[self.p_lo : self.p_hi].clone()
        self.full: torch.Tensor | None = self.p_shard if strategy.p == N else None
        self.grad_ready = False
        self.master: nn.Parameter | None = None
        self.g_acc: torch.Tensor | None = None
        if trainable:
            lo, hi = self.range(strategy.os)
            if param_dtype == torch.float32:  # the os shard nests in the p shard: update it in place
                master = self.p_shard.detach()[lo - self.p_lo : hi - self.p_lo]
            else:
                master = master_full[lo:hi].clone()
            self.master = nn.Parameter(master, requires_grad=True)
            g_lo, g_hi = self.range(strategy.g)
            # gradients are reduced and accumulated in the compute dtype (2 bytes for bf16, as in paro-spec §1)
            self.g_acc = torch.zeros(g_hi - g_lo, dtype=param_dtype)
            if strategy.p == N:
                self.p_shard.requires_grad_(True)
                self.p_shard.register_post_accumulate_grad_hook(self._on_grad)

    # -- layout -------------------------------------------------------------------------------------------
    def range(self, granularity: str) -> tuple[int, int]:
        """The slice of the padded buffer this rank holds at a granularity."""
        g = self.groups
        return _C.shard_range(self.numel, g.world, g.group_size, granularity, g.rank)

    # -- parameters: p → N (unshard) and back (reshard) --------------------------------------------------------
    def unshard(self) -> torch.Tensor:
        """Makes the whole buffer available (gathering it for p = I, G) and returns it."""
        if self.strategy.p == N:
            return self.p_shard
        if self.full is None:
            self.full = torch.empty(self.padded, dtype=self.param_dtype)
            if self.trainable:
                self.full.requires_grad_(True)
                self.full.register_post_accumulate_grad_hook(self._on_grad)
        elif self.full.untyped_storage().size() == 0:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        else:
            return self.full
        # the re-gather before backward refills the storage that forward's saved views point to; keep the
        # version counter so autograd accepts it (as FSDP does)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            self._gather_to_full(self.p_shard, self.strategy.p, self.full)
        return self.full

    def reshard(self) -> None:
        """Frees the gathered buffer (p = I, G); views keep their metadata and see it again after unshard."""
        if self.strategy.p != N and self.full is not None and self.full.untyped_storage().size() > 0:
            self.full.untyped_storage().resize_(0)

    def full_freed(self) -> bool:
        """Whether the whole buffer was gathered before and is resharded now (p = I, G)."""
        return self.full is not None and self.strategy.p != N and self.full.untyped_storage().size() == 0

    def unsharded(self) -> bool:
        """Whether the gathered whole buffer is held now (p = I, G)."""
        return self.full is not None and self.strategy.p != N and self.full.untyped_storage().size() > 0

    def _gather_to_full(self, shard: torch.Tensor, granularity: str, out: torch.Tensor) -> None:
        """Out (whole padded buffer) ← shard held at granularity: inter all-gather G→I, intra all-gather I→N."""
        g = self.groups
        out = out.detach()
        if granularity == N:
            out.copy_(shard)
            return
        i_lo, i_hi = self.range(I)
        if granularity == G:
            _all_gather(out[i_lo:i_hi], shard, g.inter, self.sent, "inter")
        else:
            out[i_lo:i_hi].copy_(shard)
        _all_gather(out, out[i_lo:i_hi], g.intra, self.sent, "intra")

    def held(self) -> tuple[torch.Tensor, int]:
        """This rank's part of the buffer, detached, and where it starts in the padded buffer.

        The master shard (os) for a trainable buffer, else the parameter shard (p).
        """
        if self.master is not None:
            return self.master.detach(), self.range(self.strategy.os)[0]
        return self.p_shard.detach(), self.p_lo

    def overlaps(self, lo: int, hi: int) -> list[tuple[ParamSlot, int, int]]:
        """(slot, start, stop) of every parameter's part inside [lo, hi) of the padded buffer (may be empty)."""
        out = []
        for s in self.slots:
            start = max(lo, s.offset)
            out.append((s, start, max(start, min(hi, s.offset + s.numel))))
        return out

    def views(self) -> list[torch.Tensor]:
        """The original parameters as views of the whole buffer (call after unshard).

        One ``split`` rather than a slice per parameter: autograd then builds the buffer's gradient with one
        concatenation, where slices would each materialise a whole-buffer gradient to be summed.
        """
        full = self.full if self.full is not None else self.p_shard
        parts = full.split(self._split_sizes)
        return [part.view(s.shape) for part, s in zip(parts, self.slots, strict=False)]

    # -- gradients ----------------------------------------------------------------------------------------------
    def _on_grad(self, full: torch.Tensor) -> None:
        """Post-accumulate-grad hook of the whole-buffer leaf: hand the gradient over, reshard."""
        assert full.grad is not None
        grad, full.grad = full.grad, None
        self.reshard()
        self.grad_ready = True
        self.on_grad_ready(self, grad)

    def reduce(self, grad: torch.Tensor) -> None:
        """One micro-step: reduces the whole-buffer gradient to g's layout and accumulates it (spec §5.1).

        Nothing for g = N, an intra-group reduce-scatter for I, then an inter-group one for G. The engine runs
        it on its communication thread, so it overlaps the backward of the units before this one.
        """
        assert self.g_acc is not None
        x = grad.to(self.g_acc.dtype) / self.groups.world  # pre-divide: sums of n ranks stay in range (fp16)
        if self.strategy.g != N:
            x = _reduce_scatter(x.contiguous(), self.rgroups.intra, self.rsent, "intra")
        if self.strategy.g == G:
            x = _reduce_scatter(x, self.rgroups.inter, self.rsent, "inter")
        self.g_acc.add_(x)

    def sync_grad(self) -> bool:
        """Accumulation boundary: bring the accumulated gradients (already means over ranks) to os's layout.

        Returns whether it created the master's ``.grad`` (it was None).
        """
        assert self.g_acc is not None and self.master is not None
        s, groups = self.strategy, self.rgroups
        x = self.g_acc
        if s.g == N:
            x = _reduce_scatter(x, groups.intra, self.rsent, "intra")
        if s.g in (N, I):  # partial sums across groups
            if s.os == G:
                x = _reduce_scatter(x, groups.inter, self.rsent, "inter")
            elif groups.inter is not None:
                x = x.clone()
                dist.all_reduce(x, group=groups.inter)
                _ring(self.rsent, "inter", groups.inter, x, times=2)
        if s.os == N:
            full = torch.empty(self.padded, dtype=x.dtype)
            _all_gather(full, x, groups.intra, self.rsent, "intra")
            x = full
        created = self.master.grad is None
        if created:
            self.master.grad = x.to(self.master.dtype, copy=True)
        else:  # synced on more than one micro-step (no no_sync): gradients add up, as with DDP
            self.master.grad.add_(x)
        self.g_acc.zero_()
        return created

    # -- parameters after the optimizer step: os → p ----------------------------------------------------------
    def sync_params(self) -> None:
        """Brings the updated os shard back to p's layout: inter all-gather G→I, intra all-gather I→N."""
        assert self.master is not None
        s = self.strategy
        os_lo, os_hi = self.range(s.os)
        p_shard = self.p_shard.detach()
        with torch.no_grad():
            if self.param_dtype != torch.float32:
                p_shard[os_lo - self.p_lo : os_hi - self.p_lo].copy_(self.master)
            if s.os != s.p:
                # work in whole-buffer coordinates: p_shard covers [p_lo, p_hi) of it
                i_lo, i_hi = self.range(I)
                if s.os == G:
                    dst = p_shard[i_lo - self.p_lo : i_hi - self.p_lo]
                    _all_gather(
                        dst, p_shard[os_lo - self.p_lo : os_hi - self.p_lo], self.groups.inter, self.sent, "inter"
                    )
                if s.p == N:
                    _all_gather(p_shard, p_shard[i_lo:i_hi], self.groups.intra, self.sent, "intra")

    def full_values(self) -> torch.Tensor:
        """The whole buffer's current values (masters for trainable parameters), gathered on every rank."""
        out = torch.empty(self.padded, dtype=torch.float32 if self.trainable else self.param_dtype)
        with torch.no_grad():
            if self.master is not None:
                self._gather_to_full(self.master.detach().to(out.dtype), self.strategy.os, out)
            else:
                self._gather_to_full(self.p_shard, self.strategy.p, out)
        return out
