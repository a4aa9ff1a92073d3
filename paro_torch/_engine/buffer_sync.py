"""Module buffers (BatchNorm statistics, rotary tables) made rank 0's, as DDP's ``broadcast_buffers``.

[Note: buffer broadcast] DDP broadcasts every buffer before every training forward: a blocking global collective
per micro-step, for buffers that are mostly constants (rotary inv_freq). Here the first step broadcasts all of
them; each rank notes which buffers changed (their version counters) since the last broadcast, the boundary's
flags all-reduce agrees on it, and the next step broadcasts before each forward those that changed on some rank
(BatchNorm statistics: every step, as DDP). A buffer changed on one rank between steps is rank 0's again from the
step after the next.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paro_torch._engine import init
from paro_torch._lanes import Lane


class BufferSync:
    """Which buffers are due for a broadcast from rank 0, and the broadcast itself."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._track(buffers)

    def _track(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = [b for b in buffers if b.numel() > 0]
        self._due = [True] * len(self.buffers)
        self._versions = [b._version for b in self.buffers]
        self.changed = [False] * len(self.buffers)
        """Per buffer: changed on this rank since the last look."""

    def rebind(self, buffers: list[torch.Tensor]) -> None:
        """The module's buffers after ``Module._apply`` replaced them: all due again, as at the start."""
        if self.buffers:  # empty: broadcast_buffers=False (or none to sync)
            self._track(buffers)

    def note_changes(self) -> None:
        """Notes the buffers whose version changed since the last look."""
        for i, b in enumerate(self.buffers):
            if b._version != self._versions[i]:
                self.changed[i] = True
                self._versions[i] = b._version

    def before_forward(self, lane: Lane, group: dist.ProcessGroup) -> None:
        """Broadcasts the due buffers from rank 0 on ``lane`` (a training forward)."""
        if not self.buffers:
            return
        self.note_changes()
        due = [b for b, d in zip(self.buffers, self._due, strict=True) if d]
        if due:
            lane.submit(init.broadcast_from_rank0, due, group).result()
            self._versions = [b._version for b in self.buffers]

    def agreed(self, changed_anywhere: list[int]) -> None:
        """At a boundary: the buffers some rank changed are due in the next step."""
        self._due = [bool(c) for c in changed_anywhere]
        self.changed = [False] * len(self.buffers)
