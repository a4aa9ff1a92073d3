"""Where each parameter's rows live: the natural layout, the blocks for communication, the DTensor shards.

Each parameter is sharded by rows, as ``torch.chunk`` and a DTensor with ``Shard(0)`` shard it: first into m
I-chunks by local rank r, then each into g G-chunks by group k. The optimizer sees each parameter's os chunk as
a DTensor on the (intra, inter) mesh, under the parameter's own name. For communication the chunks are packed
into equal blocks, one per shard at the buffer's finest granularity (paro_torch._C.RowLayout), so going N↔I is
one intra-group collective and I↔G one inter-group collective among ranks of equal local rank, on one flat
buffer (copy-in before a reduction, copy-out after a gather, as FSDP2 does). Whole parameters for compute live
in their natural layout: one tensor, the parameters back to back, which the module sees as views.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from paro_torch import _C
from paro_torch._groups import ParoGroups

N, I, G = "N", "I", "G"  # noqa: E741  (the paper's granularity letters)


def param_rows(shape: torch.Size) -> tuple[int, int, bool]:
    """(rows, elements per row, replicated) of a parameter for ``_C.RowLayout``; a 0-dim one is held whole."""
    if len(shape) == 0:
        return 1, 1, True
    numel = shape.numel()
    return shape[0], numel // shape[0] if shape[0] else 1, False


@dataclass
class ParamSlot:
    """One original parameter: where it lives in the natural layout, and its names."""

    module: nn.Module
    name: str
    fqn: str
    shape: torch.Size
    offset: int
    """Offset in the natural layout (the parameters back to back)."""
    numel: int
    aliases: list[tuple[nn.Module, str, str]] = field(default_factory=list)
    """Other (module, attribute, fqn) that share the parameter (tied weights)."""

    @property
    def names(self) -> tuple[str, ...]:
        """Its name and those it is tied under."""
        return (self.fqn, *(a[2] for a in self.aliases))

    @property
    def targets(self) -> list[tuple[nn.Module, str]]:
        """Every (module, attribute) the parameter is reached by."""
        return [(self.module, self.name), *[(a[0], a[1]) for a in self.aliases]]

    @property
    def replicated(self) -> bool:
        """A 0-dimensional parameter has no rows to shard: every block holds it whole."""
        return param_rows(self.shape)[2]

    @property
    def rows(self) -> int:
        return param_rows(self.shape)[0]

    @property
    def row_numel(self) -> int:
        return param_rows(self.shape)[1]


def placements(granularity: str) -> tuple[Placement, Placement]:
    """A DTensor's placements on the (intra, inter) mesh for a granularity (nested: I-chunk, then G-chunk)."""
    return {N: (Replicate(), Replicate()), I: (Shard(0), Replicate()), G: (Shard(0), Shard(0))}[granularity]


class BufferLayout:
    """The layout of one buffer's parameters at its level (os for trainable parameters, p for frozen ones)."""

    def __init__(
        self, slots: list[ParamSlot], groups: ParoGroups, mesh: DeviceMesh, level: str, device: torch.device
    ) -> None:
        self.slots = slots
        self.groups = groups
        self.mesh = mesh
        self.level = level
        self.device = device
        self.layout = _C.RowLayout([param_rows(s.shape) for s in slots],
                                   groups.world, groups.group_size, level)  # fmt: skip
        self.places = self.layout.places
        self.padded = self.layout.padded
        self.numel = _C.RowLayout([(s.numel, 1, False) for s in slots], groups.world, groups.group_size, N).padded
        """Elements of the natural layout: the parameters back to back, padded to a multiple of n (as at N)."""
        sizes = [s.numel for s in slots]
        self._split_sizes = [*sizes, self.numel - sum(sizes)]  # the parameters, then the padding

    def range(self, granularity: str) -> tuple[int, int]:
        """The slice of the whole (blocked, padded) buffer this rank holds at a granularity."""
        return self.layout.range(granularity, self.groups.rank)

    def _my_block(self) -> int:
        g = self.groups
        return {N: 0, I: g.local_rank, G: g.local_rank * g.num_groups + g.group_index}[self.level]

    def _locals(self, region: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's chunk as a view of this rank's block (``region``), in the parameter's shape."""
        block = self._my_block()
        out = []
        for s, (offset, _, chunks) in zip(self.slots, self.places, strict=True):
            rows = chunks[block][1]
            shape = s.shape if s.replicated else (rows, *s.shape[1:])
            out.append(region[offset : offset + rows * s.row_numel].view(shape))
        return out

    def _dtensors(self, region: torch.Tensor) -> list[DTensor]:
        out = []
        for s, local in zip(self.slots, self._locals(region), strict=True):
            pl = placements(N if s.replicated else self.level)
            stride = torch.empty(s.shape, device="meta").stride()
            out.append(DTensor.from_local(local, self.mesh, pl, run_check=False, shape=s.shape, stride=stride))
        return out

    def to_blocks(self, natural: torch.Tensor) -> torch.Tensor:
        """The natural layout → the whole blocked buffer (zeros in the padding); the same tensor at N."""
        if self.level == N:
            return natural
        parts = [natural[s.offset : s.offset + s.numel] for s in self.slots]
        return self._pack(parts, 0, self.padded, natural.dtype)

    def _pack(self, parts: list[torch.Tensor], lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements [lo, hi) of the blocked buffer (whole blocks) from each parameter's flat values, as ``dtype``."""
        size = self.layout.block_numel
        first, count = (lo // size, (hi - lo) // size) if size else (0, 0)
        out = torch.zeros(hi - lo, dtype=dtype, device=self.device)
        blocks = out.view(count, size)
        for s, part, (offset, slot_rows, chunks) in zip(self.slots, parts, self.places, strict=True):
            src = part.view(s.rows, s.row_numel)
            width = slot_rows * s.row_numel
            if count == len(chunks) and not s.replicated and s.rows == slot_rows * count:  # even: one strided copy
                blocks[:, offset : offset + width].copy_(src.reshape(count, width))
                continue
            for b in range(first, first + count):
                start, rows = chunks[b]
                if rows:
                    blocks[b - first, offset : offset + rows * s.row_numel].copy_(src[start : start + rows].reshape(-1))
        return out

    def from_blocks(self, whole: torch.Tensor, natural: torch.Tensor) -> None:
        """Writes the whole blocked buffer into the natural layout (in place)."""
        if self.level == N:
            if whole.data_ptr() != natural.data_ptr():
                natural.copy_(whole)
            return
        blocks = whole.view(self.layout.blocks, self.layout.block_numel)
        for s, (offset, slot_rows, chunks) in zip(self.slots, self.places, strict=True):
            dst = natural[s.offset : s.offset + s.numel].view(s.rows, s.row_numel)
            width = slot_rows * s.row_numel
            if not s.replicated and s.rows == slot_rows * len(chunks):
                dst.view(len(chunks), width).copy_(blocks[:, offset : offset + width])
                continue
            for b, (start, rows) in enumerate(chunks[:1] if s.replicated else chunks):
                if rows:
                    dst[start : start + rows].view(-1).copy_(blocks[b, offset : offset + rows * s.row_numel])
