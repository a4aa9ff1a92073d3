"""``FlatBuffer``: one unit's trainable (or frozen) parameters and their (g, os) schedule (PaRO-DP, spec §5.1).

Each micro-step the whole gradient is reduced to g's layout and accumulated; at the accumulation boundary the
accumulated gradient goes to os's layout (t_syncg) and becomes the masters' ``.grad``; after the optimizer step
the masters go back to p's layout (t_syncp). Layout and storage are the base classes' (``layout``, ``storage``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from paro_torch import _C
from paro_torch._engine.collectives import Ledger, all_gather, all_reduce, reduce_scatter
from paro_torch._engine.layout import G, I, N, ParamSlot
from paro_torch._engine.storage import BufferStorage
from paro_torch._groups import ParoGroups
from paro_torch.api import Precision, divide_factors


class FlatBuffer(BufferStorage):
    """The trainable (or the frozen) parameters of one unit: blocks for communication, DTensors for the optimizer."""

    def __init__(
        self,
        slots: list[ParamSlot],
        values: list[torch.Tensor],
        strategy: _C.Strategy,
        groups: ParoGroups,
        mesh: DeviceMesh,
        trainable: bool,
        precision: Precision,
        on_grad_ready: Callable[[FlatBuffer, torch.Tensor, int], None] | None = None,
        reduce_groups: ParoGroups | None = None,
        device: torch.device | None = None,
        received: tuple[int, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(slots, values, strategy, groups, mesh, trainable, precision, device, received)
        self.rledger = Ledger()
        """Reductions and t_syncg (the reduction lane)."""
        self.rgroups = reduce_groups or groups
        """The groups gradients are reduced on: a twin of ``groups`` when reductions run on their own lane."""
        self.on_grad_ready = on_grad_ready or (lambda b, grad, call: b.reduce(grad))
        self._pre, self._post = divide_factors(groups.world)
        self.grad_ready = False
        self.g_acc: torch.Tensor | None = None
        if trainable:
            g_lo, g_hi = self.range(strategy.g)
            # gradients accumulate across micro-steps in the masters' dtype (see [Note: mixed precision] in api.py)
            self.g_acc = torch.zeros(g_hi - g_lo, dtype=precision.master, device=self.device)
        # [Note: gradients in .grad] The masters' ``.grad`` exists from a window's first micro-step on, so that the
        # user's ``zero_grad()`` (optimizer's or module's) reaches the accumulator, as with DDP, and it is a view of
        # the accumulator itself: of its os range, which lies inside its g range (the layouts nest), so gradients
        # take no memory beyond the accumulator. The boundary's sync (t_syncg) writes the synced gradients there
        # and zeroes the rest of the accumulator (this window's partial sums). A ``.grad`` set to None or replaced,
        # or changed in place in the middle of a window, means the gradients were cleared: the accumulator restarts
        # from zero, so a window abandoned after some micro-steps (a NaN guard) is not carried into the next step.
        # Gradients not cleared after a boundary add up, as with DDP: set aside while the next window accumulates
        # (its sync is not linear in place), added back after it.
        if trainable:
            os_lo, os_hi = self.range(strategy.os)
            self._os_range = slice(os_lo - g_lo, os_hi - g_lo)
        self._marks: list[tuple[torch.Tensor, int]] | None = None
        """The ``.grad`` of each parameter as the engine last left it, and its version (None: not set by us); the
        engine writes the accumulator under them (their local tensors), which leaves their own versions alone."""
        self._window = False
        """A window (micro-steps since the last boundary) has started."""
        self._attached = False
        """This window's ``.grad`` were attached by the engine (they were None): unused everywhere, dropped."""
        self._carried: torch.Tensor | None = None
        """The synced gradients a window found in ``.grad`` (not cleared), added back after its sync."""

    def prepare_grads(self) -> None:
        """Before a micro-step's reduction is queued: restart a cleared accumulator, attach this window's ``.grad``.

        On the caller's thread (see [Note: gradients in .grad]); no reduction of this buffer is in flight.
        """
        assert self.g_acc is not None
        if self._marks is not None and self._cleared():
            self.g_acc.zero_()
            self._marks, self._carried = None, None
        if self._marks is None:
            self._attached = all(p.grad is None for p in self.params)
            old = [p.grad for p in self.params]
            for p, local in zip(self.params, self._locals(self.g_acc[self._os_range]), strict=True):
                p.grad = self._grad_of(p, local)
            if not self._attached:  # the user's own gradients: added to what this window accumulates
                for p, g in zip(self.params, old, strict=True):
                    if g is not None:
                        p.grad.add_(g)
            self._window = True
            self._mark()
        elif not self._window:  # a new window over gradients the user kept: they add up
            self._window = True
            self._attached = False
            if self.strategy.g != G:  # its sync is not linear in place: set them aside
                self._carried = self.g_acc[self._os_range].clone()
                self.g_acc.zero_()
            self._mark()  # edits since the boundary are the user's gradients, not a clearing mid-window

    def retype(self, precision: Precision) -> None:
        """``BufferStorage.retype``, between optimizer steps: the accumulator restarts in the masters' new dtype."""
        if self._window:
            raise RuntimeError(
                "ParoShardedModule: a dtype change (.to(dtype), .double(), ...) after a backward whose gradients have "
                "not reached an optimizer step (an accumulation window or no_sync); convert between steps"
            )
        super().retype(precision)
        if self.g_acc is not None:  # after a boundary: the gradients the user keeps, converted by _apply in .grad
            self.g_acc = torch.zeros(self.g_acc.numel(), dtype=precision.master, device=self.device)
        self._marks, self._carried = None, None

    def _grad_of(self, p: torch.Tensor, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    def _mark(self) -> None:
        self._marks = [(p.grad, p.grad._version) for p in self.params]  # type: ignore[misc]

    def _cleared(self) -> bool:
        assert self._marks is not None
        for p, (grad, version) in zip(self.params, self._marks, strict=True):
            # replaced or set to None; or changed in place mid-window (zero_grad(set_to_none=False))
            if p.grad is not grad or self._window and grad._version != version:
                return True
        return False

    def _on_grad(self, leaf: torch.Tensor, call: int) -> None:
        """Post-accumulate-grad hook of a call's whole-buffer leaf: hand the gradient over, reshard."""
        assert leaf.grad is not None
        grad, leaf.grad = leaf.grad, None
        self.reshard()
        self.grad_ready = True
        self.on_grad_ready(self, grad, call)

    def reduce(self, grad: torch.Tensor | None) -> None:
        """One micro-step: reduces the natural-layout gradient (None: zeros) to g's layout and accumulates it.

        Nothing for g = N, an intra-group reduce-scatter for I, then an inter-group one for G. The engine runs
        it on its reduction lane, so it overlaps the backward of the units before this one.
        """
        assert self.g_acc is not None
        if self.strategy.g == N:  # reduced at the boundary only (sync_grad)
            if grad is not None:
                self.g_acc.add_(self.to_blocks(grad))
            return
        # in reduce_dtype, divided by n in two factors around the sums (as FSDP), so fp16 neither over- nor underflows
        if grad is None:  # this rank's share of a gradient other ranks have: zeros, made at the blocked size
            x = torch.zeros(self.padded, dtype=self.precision.reduce, device=self.device)
        else:
            x = self.to_blocks(grad.to(self.precision.reduce) / self._pre)
        x = reduce_scatter(x, self.rgroups.intra, self.rledger, "intra")
        if self.strategy.g == G:
            x = reduce_scatter(x, self.rgroups.inter, self.rledger, "inter")
        self.g_acc.add_(x / self._post)

    def sync_grad(self) -> bool:
        """Accumulation boundary (t_syncg): bring the accumulated gradients (means over ranks) to os's layout.

        Returns whether it created the parameters' ``.grad`` (they were None).
        """
        assert self.g_acc is not None
        s, groups = self.strategy, self.rgroups
        if s.g != G:  # at g = G the accumulator is at os's layout already (see [Note: gradients in .grad])
            x = self.g_acc.to(self.precision.reduce)  # collectives in reduce_dtype
            if s.g == N:  # local sums: the division by n, as in reduce
                x = x / self._pre
                x = reduce_scatter(x, groups.intra, self.rledger, "intra")
            if s.os == G:  # partial sums across groups
                x = reduce_scatter(x, groups.inter, self.rledger, "inter")
            elif groups.inter is not None:
                x = all_reduce(x, groups.inter, self.rledger, "inter")
            if s.os == N:  # NNN: reduce-scatter, all-reduce across groups, all-gather: a hierarchical all-reduce
                full = torch.empty(self.padded, dtype=x.dtype, device=self.device)
                all_gather(full, x, groups.intra, self.rledger, "intra")
                x = full
            if s.g == N:
                x = x / self._post
            if x is not self.g_acc:
                self.g_acc.zero_()  # this window's partial sums
                self.g_acc[self._os_range].copy_(x)
        if self._carried is not None:
            self.g_acc[self._os_range].add_(self._carried)
            self._carried = None
        self._window = False
        self._mark()
        return self._attached

    def clear_grads(self) -> None:
        """No gradients, and an empty accumulator (a buffer unused everywhere, or a failed backward)."""
        for p in self.params:
            p.grad = None
        if self.g_acc is not None:
            self.g_acc.zero_()
        self._marks, self._carried, self._window = None, None, False

    def sync_params(self) -> None:
        """t_syncp: brings the updated os shards back to p's layout: inter all-gather G→I, intra all-gather I→N."""
        assert self._master_region is not None
        s = self.strategy
        os_lo, os_hi = self.range(s.os)
        p_shard = self.p_shard.detach()
        master = self._master_region
        with torch.no_grad():
            if s.p != N:
                if master.data_ptr() != p_shard[os_lo - self.p_lo :].data_ptr():
                    p_shard[os_lo - self.p_lo : os_hi - self.p_lo].copy_(master)
                if s.os != s.p:  # p = I, os = G
                    i_lo, i_hi = self.range(I)
                    dst = p_shard[i_lo - self.p_lo : i_hi - self.p_lo]
                    all_gather(
                        dst, p_shard[os_lo - self.p_lo : os_hi - self.p_lo], self.groups.inter, self.ledger, "inter"
                    )
            elif s.os == N:
                if master.data_ptr() != p_shard.data_ptr():
                    p_shard.copy_(master)
            else:  # p = N keeps the natural layout: gather the blocks, then copy out
                whole = torch.empty(self.padded, dtype=self.param_dtype, device=self.device)
                self._gather_to_whole(master.to(self.param_dtype), s.os, whole)
                with self._unpack(whole, s.os):
                    self.from_blocks(whole, p_shard)
