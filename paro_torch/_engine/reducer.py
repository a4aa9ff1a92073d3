"""Gradient reductions in one fixed order on every rank, on the reduction lane.

[Note: reduction order] Reductions go out in one order on every rank (the reverse of the agreed run order, root
last: see [Note: run order] in gathers.py), whatever order autograd completes them in: a gradient that completes
early waits for those before it. A buffer whose gradient will not come (autograd's plan for this backward does
not reach it, and its unit did not run under a reentrant checkpoint, whose backward is a separate one) is reduced
as zeros at its turn, from the start of backward, so the gradients after it do not wait for the end; the result
is the mean over ranks with zeros where unused, as DDP's find_unused_parameters. Which buffers were used is
agreed at each boundary (one small all-reduce after the reductions): one unused on every rank keeps its gradient
None, as in single-process training.

[Note: forwards before one backward] At p = I, G each forward with grad since the last backward (a call) has leaves
of its own (see ``BufferStorage.begin_call``), so that a unit's gradient from each call completes, and is reduced and
freed, as that call's backward passes the unit; one shared leaf would hold every unit gathered, and its gradient in
autograd's buffers, until the first call's backward (two forwards before one backward: reward models' chosen and
rejected, contrastive losses). The sequence then repeats the units' order once per call that this backward reaches,
the last call first (autograd runs the later call's backward first); the boundary's sync follows a buffer's last
reduction. A unit run twice within one call (shared weights) keeps one leaf: one reduction.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from paro_torch._comms import EngineComms
from paro_torch._engine.flat_buffer import FlatBuffer
from paro_torch._engine.layout import N
from paro_torch._engine.units import TrainingState, Unit
from paro_torch._lanes import Handle, Lane


class OrderedReducer:
    """Reduces each micro-step's gradients (and at a boundary syncs them, t_syncg) in the fixed order."""

    def __init__(self, units: list[Unit], comms: EngineComms, device: torch.device) -> None:
        self.lane: Lane = comms.reducer
        self._comms = comms  # its communicators are released at exit (see [Note: communicators at exit])
        self.sync_gradients = True
        """Whether this backward is an accumulation boundary (``no_sync`` turns it off)."""
        self.order = [b for u in units for b in u.buffers if b.trainable]
        self._index = {id(b): i for i, b in enumerate(self.order)}
        self._unit_of = {id(b): u for u in units for b in u.buffers}
        self.sequence: list[tuple[int, int]] = [(0, i) for i in range(len(self.order))]
        """(call, index into ``order``) in the order reductions go out (see [Note: reduction order])."""
        self._turn = {key: k for k, key in enumerate(self.sequence)}
        self._last = {key[1]: key for key in self.sequence}
        """Per buffer: its last reduction in this backward (the boundary's sync follows it)."""
        self._pending: list[Handle[None]] = []
        self._ready: dict[tuple[int, int], torch.Tensor | None] = {}
        self._next = 0
        self._device = device
        self.used = [0] * len(self.order)
        """Per trainable buffer: whether its gradient came on this rank since the last boundary."""
        self._created_grad: set[int] = set()
        self.overlapped_syncs = 0
        """Boundary gradient syncs queued during backward, as each buffer's gradient completed."""

    def unit_of(self, buffer: FlatBuffer) -> Unit:
        return self._unit_of[id(buffer)]

    def set_sequence(self, units: list[Unit], calls: list[int] | None = None) -> None:
        """The order reductions go out in from the next backward on: ``units``' buffers, once per call in ``calls``.

        ``calls``: the calls this backward reaches, last first (default: one; see [Note: forwards before one
        backward]).
        """
        assert not self._ready and self._next == 0, "the reduction order changes only between backwards"
        base = [self._index[id(b)] for u in units for b in u.buffers if b.trainable]
        self.sequence = [(c, i) for c in (calls or [0]) for i in base]
        self._turn = {key: k for k, key in enumerate(self.sequence)}
        self._last = {key[1]: key for key in self.sequence}

    def absent(self, slots: list[tuple[FlatBuffer, int]]) -> None:
        """(buffer, call)s whose gradient will not come in this backward: reduced as zeros at their turn.

        Queued with the next gradient that completes, about when the other ranks queue theirs, rather than now:
        a reduction waits for every rank, and holds its buffers meanwhile.
        """
        for b, call in slots:
            key = (call, self._index[id(b)])
            if key in self._turn:
                self._ready.setdefault(key, None)

    def grad_ready(self, buffer: FlatBuffer, grad: torch.Tensor, call: int = 0) -> None:
        """A buffer's gradient is complete: queue the reductions now due in the fixed order.

        They run on the reduction lane while the units before this one compute their backward; a g = N micro-step
        without sync only sums locally, which ``flush`` does in place.
        """
        i = self._index[id(buffer)]
        key = (call, i)
        if key not in self._turn or key in self._ready or self._turn[key] < self._next:
            raise RuntimeError(
                f"paro_torch: the gradient of the unit holding {buffer.slots[0].fqn} completed twice in one "
                "backward; a unit's parameters must reach the loss through one backward pass per micro-step"
            )
        self.used[i] = 1
        self._ready[key] = grad
        unit = self._unit_of[id(buffer)]
        if all(b.grad_ready or not b.trainable for b in unit.buffers):
            unit.state = TrainingState.POST_BACKWARD
        self.flush()

    def flush(self) -> None:
        """Queues every reduction whose turn has come."""
        while self._next < len(self.sequence) and self.sequence[self._next] in self._ready:
            key = self.sequence[self._next]
            grad = self._ready.pop(key)
            self._next += 1
            i = key[1]
            sync = self.sync_gradients and self._last[i] == key
            self.order[i].prepare_grads()
            if self.order[i].strategy.g == N and not sync:
                # a local sum, no collective: here, not through the lane (on CPU a thread handoff per unit)
                self._reduce_and_sync(i, grad, sync=False)
                continue
            self._pending.append(self.lane.submit(self._reduce_and_sync, i, grad, sync))
            self.overlapped_syncs += sync

    def _reduce_and_sync(self, i: int, grad: torch.Tensor | None, sync: bool) -> None:
        buffer = self.order[i]
        buffer.reduce(grad)
        if sync and buffer.sync_grad():
            self._created_grad.add(i)

    def finish(self, tail: list[int]) -> torch.Tensor:
        """At the end of backward: reduce the buffers that got no gradient as zeros, wait for every reduction.

        Returns this rank's use flags followed by ``tail``; at a boundary summed over all ranks.
        """
        for key in self.sequence[self._next :]:
            self._ready.setdefault(key, None)  # unused on this rank in this micro-step
        self.flush()
        self._next = 0
        flags = torch.tensor([*self.used, *tail], dtype=torch.int64, device=self._device)
        if self.sync_gradients:
            self._pending.append(self.lane.submit(dist.all_reduce, flags, group=self._comms.reduce_groups.whole))
        while self._pending:
            self._pending.pop(0).result()
        return flags

    def after_boundary(self, used: list[int]) -> None:
        """Gradients of buffers unused on every rank in the window stay None, as in one process."""
        for i in self._created_grad:
            if used[i] == 0:
                self.order[i].clear_grads()
        self._created_grad.clear()
        self.used = [0] * len(self.order)

    def drop(self) -> None:
        """After a failed backward: waits out what was issued and drops every gradient since the last boundary."""
        for handle in self._pending:
            with contextlib.suppress(Exception):  # a reduction that failed with the backward
                handle.result()
        self._pending.clear()
        self._ready.clear()
        self._next = 0
        for b in self.order:
            b.clear_grads()  # a boundary sync of the failed backward may have created some after zero_grad()
        self.used = [0] * len(self.order)
        self._created_grad.clear()
