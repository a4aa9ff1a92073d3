"""The gather schedule: each unit's parameters unsharded (and t_syncp run) just ahead of its compute.

[Note: communication lanes] Gathers (and t_syncp) run on one lane, reductions (and t_syncg) on another, each on
its own communicators, so that neither waits for the other and each one's sequence of collectives is the same on
every rank:
- gathers follow one order per pass, the same on every rank (see [Note: run order]), one or more units ahead of
  the computation (prefetch). A unit needed out of order, or skipped on this rank, is gathered anyway at its
  place (and freed when the pass ends), so every rank gathers the same units in the same order; the root unit
  comes first in both passes, since it wraps the whole forward;
- reductions follow one order too (see [Note: reduction order] in reducer.py).
On CUDA each lane is a stream instead of a thread (see [Note: lanes] in paro_torch/_lanes.py). Modules on the same
groups share both (see [Note: shared lanes] in paro_torch/_comms.py).

[Note: run order] Each forward records the order its units first run in. The all-reduce that agrees, after a
forward with grad, on the units backward needs (p = I, G) carries these positions too (the earliest over ranks),
and every rank derives from the agreed positions the same orders: the next forward's gathers (units in run order,
then the units no rank ran), this backward's (the reverse, root first) and its reductions. So a model whose run
order is not its registration order (a UNet's down, mid and up blocks) holds only the prefetch window, from the
second step on (the first forward follows registration order). Units no rank ran in the last agreed forward
(a vision tower on text-only batches) are dormant: no gather reaches them until the ranks agree (one small
all-reduce per pass, only where dormant units exist, when a forward ends or when a rank first runs a dormant
unit, which then waits for the others' end of forward) whether any rank runs one; if so, every rank gathers all
of them, else none. At p = N (no gathers) the reductions' order comes from the positions summed
in the boundary's agreement instead.
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
    """Issues the units' gathers on the gather lane in the pass's agreed order, ``gather_ahead`` units ahead."""

    def __init__(self, units: list[Unit], strategy: _C.Strategy, comms: EngineComms, device: torch.device) -> None:
        self.units = units
        self.strategy = strategy
        self.lane: Lane = comms.gathers
        self._comms = comms  # its communicators are released at exit (see [Note: communicators at exit])
        self._device = device
        self.gather_ahead = strategy.gather_ahead
        """Units past the computing one whose gathers may be in flight: the cost model's rule (its IssuePolicy)."""
        self.fwd_order = list(reversed(units))  # root first; then run order (see [Note: run order])
        self._dormant_from = len(units)
        """Index in ``fwd_order`` of the first unit no rank ran in the last agreed forward."""
        self._pass: list[Unit] = []
        self._pass_pos: dict[Unit, int] = {}
        self._pass_next = 0
        self._pass_limit = 0
        """Gathers stop before this index of the pass (the dormant units: see [Note: run order])."""
        self._woken = False
        self._gathered: dict[Unit, Handle[None]] = {}
        self._bwd_flags: list[tuple[torch.Tensor, Handle[Any]]] = []
        n = len(units)
        self.needs_bwd = [0] * n
        """Per unit: whether this forward left it a backward to gather for (p = I, G)."""
        self.run_keys = [0] * n
        """Per unit: n - its position in this forward's run order (root n), 0 where it did not run."""
        self._runs = 0
        self.ran_without_grad: set[int] = set()
        """Units run with grad disabled in a forward with grad since the last backward started (a reentrant
        checkpoint): their gradients come from a backward of their own, which autograd's plan does not show."""
        self.prefetches = 0
        """Parameter gathers started ahead of their unit's forward or backward (for tests and profiling)."""
        self.peak_unsharded = {"forward": 0, "backward": 0}
        """Most units holding gathered parameters at once (p = I, G), seen when a unit's parameters are acquired."""

    # ------------------------------------------------------------------------------------------ run order
    def set_run_order(self, keys: list[int]) -> None:
        """Agreed run positions (larger first; 0: ran nowhere) → the forward order (see [Note: run order])."""
        pos = {u: k for k, u in enumerate(self.fwd_order)}
        ran = sorted((u for u in self.units if keys[u.index] > 0), key=lambda u: (-keys[u.index], pos[u]))
        dormant = [u for u in self.fwd_order if keys[u.index] <= 0]
        self.fwd_order = ran + dormant
        self._dormant_from = len(ran) if self.strategy.p != N else len(self.units)

    def reduce_order(self) -> list[Unit]:
        """The units in the order their gradients complete: the reverse of the run order, root, then dormant."""
        ran = self.fwd_order[: self._dormant_from]
        root = self.units[-1]
        return [*(u for u in reversed(ran) if u is not root), root, *self.fwd_order[self._dormant_from :]]

    def record_run(self, unit: Unit) -> None:
        """The unit runs in a forward with grad (also under a reentrant checkpoint's no_grad)."""
        if not torch.is_grad_enabled():
            self.ran_without_grad.add(unit.index)
        if self.run_keys[unit.index] == 0:
            self.run_keys[unit.index] = len(self.units) - self._runs
            self._runs += 1

    # --------------------------------------------------------------------------------------------- passes
    def begin_pass(self, order: list[Unit], limit: int | None = None) -> None:
        self._pass, self._pass_next = order, 0
        self._pass_pos = {u: i for i, u in enumerate(order)}
        self._pass_limit = len(order) if limit is None else limit
        self._woken = False

    def begin_forward(self) -> None:
        """A forward's pass over every unit, root first; at p = N every t_syncp is queued at once."""
        self.begin_pass(self.fwd_order, limit=self._dormant_from)
        self.needs_bwd = [0] * len(self.units)
        self.run_keys = [0] * len(self.units)
        self._runs = 0
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
            return
        if i >= self._pass_limit:  # a dormant unit runs here
            self._wake_dormant(True)
        self.submit_through(i)
        pending = self._gathered.pop(unit, None)
        if prefetch and self._pass_next < len(self._pass):
            before = len(self._gathered)
            ahead = len(self._pass) if self.gather_ahead is None else self.gather_ahead
            self.submit_through(min(i + ahead, self._pass_limit - 1))
            self.prefetches += len(self._gathered) - before
        if pending is not None:
            pending.result()
        if self.strategy.p != N:
            phase = "backward" if backward else "forward"
            held = sum(u.unsharded() for u in self.units)
            self.peak_unsharded[phase] = max(self.peak_unsharded[phase], held)

    def _wake_dormant(self, wanted: bool) -> None:
        """Agrees whether any rank runs a dormant unit in this pass; if so, every rank gathers all of them.

        Every rank calls it once per pass with dormant units, right after the gathers before them: a rank that
        needs one mid-forward waits here for the others' end of forward (see [Note: run order]).
        """
        self.submit_through(self._pass_limit - 1)
        flag = torch.tensor([int(wanted)], dtype=torch.int64, device=self._device)
        self.lane.submit(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=self._comms.gather_world).result()
        self._pass_limit = len(self._pass) if flag.item() else self._pass_next
        self._woken = True

    def end_pass(self) -> None:
        """Gathers what the pass has not (units skipped on this rank), waits for every gather, reshards the rest.

        The leftovers are gathered one window at a time (the prefetch window), each freed once done.
        """
        if self._pass_limit < len(self._pass) and not self._woken:
            self._wake_dormant(False)
        window = 1 + (self.gather_ahead or 0)
        while self._pass_next < self._pass_limit or self._gathered:
            if self._pass_next < self._pass_limit and len(self._gathered) <= window:
                self.submit_through(self._pass_next)
                continue
            unit = next(iter(self._gathered))  # the oldest
            self._gathered.pop(unit).result()
            if self.strategy.p != N:
                unit.reshard()
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
        """Queues the all-reduce that agrees on the units backward gathers and their run order (p = I, G)."""
        flags = torch.tensor([*self.needs_bwd, *self.run_keys], dtype=torch.int64, device=self._device)
        handle = self.lane.submit(dist.all_reduce, flags, op=dist.ReduceOp.MAX, group=self._comms.gather_world)
        self._bwd_flags.append((flags, handle))
        if len(self._bwd_flags) > 4:  # forwards with grad and no backward (an evaluation without no_grad)
            folded = torch.zeros_like(flags)
            for f, h in self._bwd_flags:
                h.result()
                folded = torch.maximum(folded, f)
            done: Future[None] = Future()
            done.set_result(None)
            self._bwd_flags = [(folded, done)]

    def begin_backward(self, keep: bool = False) -> None:
        """Backward's pass: the units some rank needs, root first (its output's hook fires first), then reversed.

        ``keep``: the forwards' agreement stays for the next backward (this one only reaches the inputs).
        """
        n = len(self.units)
        agreed = torch.zeros(2 * n, dtype=torch.int64, device=self._device)
        for flags, fut in self._bwd_flags:
            fut.result()
            agreed = torch.maximum(agreed, flags)
        if not keep:
            self._bwd_flags.clear()
        values = agreed.tolist()  # one device-to-host copy per backward
        needs, keys = values[:n], values[n:]
        if any(keys):
            self.set_run_order(keys)
        root = self.units[-1]
        order = [root, *(u for u in reversed(self.fwd_order) if u is not root)]
        self.begin_pass([u for u in order if needs[u.index]])
