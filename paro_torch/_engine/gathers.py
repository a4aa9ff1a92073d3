"""The gather schedule: each unit's parameters unsharded (and t_syncp run) just ahead of its compute.

[Note: communication lanes] Gathers (and t_syncp) run on one lane, reductions (and t_syncg) on another, each on
its own communicators, so that neither waits for the other and each one's sequence of collectives is the same on
every rank:
- gathers follow one fixed order per pass (forward: units in definition order, root first; backward: the
  reverse, over the units some rank needs in backward, agreed by a small all-reduce when forward ends). A unit
  needed out of order, or skipped on this rank, is gathered anyway at its place (and freed when the pass ends),
  so every rank gathers the same units in the same order, one ahead of the computation (prefetch); the root unit
  comes first in both, since it wraps the whole forward;
- reductions follow one fixed order too (see [Note: reduction order] in reducer.py).
On CUDA each lane is a stream instead of a thread (see [Note: lanes] in paro_torch/_lanes.py). Modules on the same
groups share both (see [Note: shared lanes] in paro_torch/_comms.py).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from paro_torch import _C
from paro_torch._comms import EngineComms
from paro_torch._engine.layout import N
from paro_torch._engine.units import Unit
from paro_torch._lanes import Handle, Lane


class GatherSchedule:
    """Issues the units' gathers on the gather lane in the pass's fixed order, ``gather_ahead`` units ahead."""

    def __init__(self, units: list[Unit], strategy: _C.Strategy, comms: EngineComms, device: torch.device) -> None:
        self.units = units
        self.strategy = strategy
        self.lane: Lane = comms.gathers
        self._comms = comms  # its communicators are released at exit (see [Note: communicators at exit])
        self.gather_ahead = strategy.gather_ahead
        """Units past the computing one whose gathers may be in flight: the cost model's rule (its IssuePolicy)."""
        self.fwd_order = list(reversed(units))  # root first
        self._pass: list[Unit] = []
        self._pass_pos: dict[Unit, int] = {}
        self._pass_next = 0
        self._gathered: dict[Unit, Handle[None]] = {}
        self._bwd_flags: list[tuple[torch.Tensor, Handle[Any]]] = []
        self.needs_bwd = torch.zeros(len(units), dtype=torch.int64, device=device)
        """Per unit: whether this forward left it a backward to gather for (p = I, G)."""
        self.prefetches = 0
        """Parameter gathers started ahead of their unit's forward or backward (for tests and profiling)."""
        self.peak_unsharded = {"forward": 0, "backward": 0}
        """Most units holding gathered parameters at once (p = I, G), seen when a unit's parameters are acquired."""

    def begin_pass(self, order: list[Unit]) -> None:
        self._pass, self._pass_next = order, 0
        self._pass_pos = {u: i for i, u in enumerate(order)}

    def begin_forward(self) -> None:
        """A forward's pass over every unit, root first; at p = N every t_syncp is queued at once."""
        self.begin_pass(self.fwd_order)
        self.needs_bwd.zero_()
        if self.gather_ahead is None:  # p = N: every unit's t_syncp now (see IssuePolicy in the cost model)
            root = self.fwd_order[0]
            self.submit_through(len(self.fwd_order) - 1)
            self.prefetches += len(self._gathered) - (root in self._gathered)

    def _gather_due(self, unit: Unit) -> bool:
        """Whether the unit has communication to run before it computes: a gather (p = I, G) or a t_syncp."""
        return self.strategy.p != N or unit.needs_sync

    def submit_through(self, i: int) -> None:
        """Queues the gathers of the pass's units up to index ``i``, in order (see [Note: communication lanes])."""
        while self._pass_next <= min(i, len(self._pass) - 1):
            u = self._pass[self._pass_next]
            self._pass_next += 1
            if self._gather_due(u) and u not in self._gathered:
                self._gathered[u] = self.lane.submit(u.gather)

    def acquire(self, unit: Unit, backward: bool, prefetch: bool = True) -> None:
        """Makes the unit's parameters available now, queuing the gathers due before it and the next one."""
        i = self._pass_pos.get(unit)
        if i is None or i < self._pass_next and unit not in self._gathered:
            # outside the pass (e.g. a unit run twice in a forward): a gather of its own, as on every rank
            if self._gather_due(unit) or any(b.full_freed() for b in unit.buffers):
                self.lane.submit(unit.gather).result()
                self.lane.hand_over(b.full for b in unit.buffers if b.full is not None)
            return
        self.submit_through(i)
        pending = self._gathered.pop(unit, None)
        if prefetch and self._pass_next < len(self._pass):
            before = len(self._gathered)
            ahead = len(self._pass) if self.gather_ahead is None else self.gather_ahead
            self.submit_through(i + ahead)
            self.prefetches += len(self._gathered) - before
        if pending is not None:
            pending.result()
            self.lane.hand_over(b.full for b in unit.buffers if b.full is not None)
        if self.strategy.p != N:
            phase = "backward" if backward else "forward"
            held = sum(u.unsharded() for u in self.units)
            self.peak_unsharded[phase] = max(self.peak_unsharded[phase], held)

    def end_pass(self) -> None:
        """Gathers what the pass has not (units skipped on this rank), waits for every gather, reshards the rest."""
        self.submit_through(len(self._pass) - 1)
        for unit, fut in self._gathered.items():
            fut.result()
            if self.strategy.p != N:
                unit.reshard()
        self._gathered.clear()
        self.begin_pass([])

    def drop_pass(self) -> None:
        """Waits for the gathers the pass issued and frees them.

        It issues none of the rest (ranks that failed alike issued the same), so that a failure does not gather
        the whole model at once.
        """
        for fut in self._gathered.values():
            with contextlib.suppress(Exception):
                fut.result()
        self._gathered.clear()
        self.begin_pass([])

    def forget_forwards(self) -> None:
        """Drops the agreements of forwards whose backward will not run (after a failed backward)."""
        self._bwd_flags.clear()

    def agree_after_forward(self) -> None:
        """Queues the all-reduce that agrees on the units backward gathers (p = I, G), on the gather lane."""
        flags = self.needs_bwd.clone()
        handle = self.lane.submit(dist.all_reduce, flags, op=dist.ReduceOp.MAX, group=self._comms.gather_world)
        self._bwd_flags.append((flags, handle))
        if len(self._bwd_flags) > 4:  # forwards with grad and no backward (an evaluation without no_grad)
            folded = torch.zeros_like(flags)
            for f, h in self._bwd_flags:
                h.result()
                folded |= f
            done: Future[None] = Future()
            done.set_result(None)
            self._bwd_flags = [(folded, done)]

    def begin_backward(self, keep: bool = False) -> None:
        """Backward's pass: the units some rank needs, root first (its output's hook fires first), then reversed.

        ``keep``: the forwards' agreement stays for the next backward (this one only reaches the inputs).
        """
        needs = torch.zeros_like(self.needs_bwd)
        for flags, fut in self._bwd_flags:
            fut.result()
            needs |= flags
        if not keep:
            self._bwd_flags.clear()
        order = [self.units[-1], *self.units[:-1]]
        self.begin_pass([u for u in order if needs[u.index]])
