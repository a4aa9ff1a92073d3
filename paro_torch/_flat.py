"""One unit's parameters in a flat buffer for communication, and per parameter for the optimizer (PaRO-DP).

Each parameter is sharded by rows, as ``torch.chunk`` and a DTensor with ``Shard(0)`` shard it: first into m
I-chunks by local rank r, then each into g G-chunks by group k. The optimizer sees each parameter's os chunk as
a DTensor on the (intra, inter) mesh, under the parameter's own name. For communication the chunks are packed
into equal blocks, one per shard at the buffer's finest granularity (paro_torch._C.RowLayout), so going N↔I is
one intra-group collective and I↔G one inter-group collective among ranks of equal local rank, on one flat
buffer (copy-in before a reduction, copy-out after a gather, as FSDP2 does). Whole parameters for compute live
in their natural layout: one tensor, the parameters back to back, which the module sees as views.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from paro_torch import _C
from paro_torch._groups import ParoGroups
from paro_torch.api import Precision, divide_factors

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


@dataclass
class Ledger:
    """What the collectives one communication thread ran on a buffer cost this rank.

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


def _all_gather(out: torch.Tensor, x: torch.Tensor, pg: dist.ProcessGroup | None, ledger: Ledger, level: str) -> None:
    out, x = out.detach(), x.detach()  # collectives write in place; autograd must not see them
    if pg is None:
        out.copy_(x)
        return
    shares = x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    with ledger.call("all_gather", level, pg, out):
        dist.all_gather_into_tensor(out, x.clone() if shares else x, group=pg)


def _weak(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A tensor hook that calls ``method`` while its object lives.

    A hook on a tensor that its own object holds must not hold the object: autograd keeps tensor hooks where
    Python's garbage collector cannot see the cycle, and the buffer (with its module) would never be freed.
    """
    ref = weakref.WeakMethod(method)

    def hook(t: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(t)

    return hook


def placements(granularity: str) -> tuple[Placement, Placement]:
    """A DTensor's placements on the (intra, inter) mesh for a granularity (nested: I-chunk, then G-chunk)."""
    return {N: (Replicate(), Replicate()), I: (Shard(0), Replicate()), G: (Shard(0), Shard(0))}[granularity]


class FlatBuffer:
    """The trainable (or the frozen) parameters of one unit: blocks for communication, DTensors for the optimizer.

    A trainable buffer is laid out at os, its finest granularity in every valid strategy; a frozen one at p.
    """

    def __init__(
        self,
        slots: list[ParamSlot],
        values: list[torch.Tensor],
        strategy: _C.Strategy,
        groups: ParoGroups,
        mesh: DeviceMesh,
        trainable: bool,
        precision: Precision,
        on_grad_ready: Callable[[FlatBuffer, torch.Tensor], None] | None = None,
        reduce_groups: ParoGroups | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.slots = slots
        self.ledger = Ledger()
        """Gathers and t_syncp (the gather thread)."""
        self.rledger = Ledger()
        """Reductions and t_syncg (the reduction thread)."""
        self.rgroups = reduce_groups or groups
        """The groups gradients are reduced on: a twin of ``groups`` when reductions run on their own thread."""
        self.on_grad_ready = on_grad_ready or (lambda b, grad: b.reduce(grad))
        self.strategy = strategy
        self.groups = groups
        self.mesh = mesh
        self.trainable = trainable
        self.precision = precision
        self.param_dtype = param_dtype = precision.param
        self._pre, self._post = divide_factors(groups.world)
        self.device = device if device is not None else torch.device("cpu")
        self.level = strategy.os if trainable else strategy.p
        self.layout = _C.RowLayout([param_rows(s.shape) for s in slots],
                                   groups.world, groups.group_size, self.level)  # fmt: skip
        self.places = self.layout.places
        self.padded = self.layout.padded
        self.numel = _C.RowLayout([(s.numel, 1, False) for s in slots], groups.world, groups.group_size, N).padded
        """Elements of the natural layout: the parameters back to back, padded to a multiple of n (as at N)."""
        sizes = [s.numel for s in slots]
        self._split_sizes = [*sizes, self.numel - sum(sizes)]  # the parameters, then the padding
        # each parameter's values, flat; only this rank's blocks are copied out of them (a meta-device model's
        # unit exists whole only as these)
        parts = [v.detach().reshape(-1) for v in values]
        self.p_lo, self.p_hi = self.range(strategy.p)
        # p-shard: the persistent parameter storage (the whole natural layout when p = N)
        if strategy.p == N:
            self.p_shard = torch.zeros(self.numel, dtype=param_dtype, device=self.device)
            for s, part in zip(slots, parts, strict=True):
                self.p_shard[s.offset : s.offset + s.numel] = part
        else:
            self.p_shard = self._pack(parts, self.p_lo, self.p_hi, param_dtype)
        self.full: torch.Tensor | None = self.p_shard if strategy.p == N else None
        self.grad_ready = False
        self.g_acc: torch.Tensor | None = None
        self._master_region: torch.Tensor | None = None
        self.params: list[nn.Parameter] = []
        """Per slot: this rank's shard as a DTensor parameter (os for trainable, p for frozen), original shape."""
        if trainable:
            lo, hi = self.range(strategy.os)
            shares = param_dtype == torch.float32 and (strategy.p != N or strategy.os == N)
            if shares:  # the os block is part of the p-shard: the optimizer updates the parameters in place
                self._master_region = self.p_shard.detach()[lo - self.p_lo : hi - self.p_lo]
            else:
                self._master_region = self._pack(parts, lo, hi, torch.float32)
            g_lo, g_hi = self.range(strategy.g)
            # gradients accumulate across micro-steps in float32 (or reduce_dtype, where the user set one)
            self.g_acc = torch.zeros(g_hi - g_lo, dtype=precision.accumulate, device=self.device)
            if strategy.p == N:
                self.p_shard.requires_grad_(True)
                self.p_shard.register_post_accumulate_grad_hook(_weak(self._on_grad))
            self.params = [nn.Parameter(t, requires_grad=True) for t in self._dtensors(self._master_region)]
        else:
            self.params = [nn.Parameter(t, requires_grad=False) for t in self._dtensors(self.p_shard.detach())]

    # -- layout -------------------------------------------------------------------------------------------
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

    # -- parameters: p → N (unshard) and back (reshard) --------------------------------------------------------
    def unshard(self) -> torch.Tensor:
        """Makes the whole natural buffer available (gathering it for p = I, G) and returns it."""
        if self.strategy.p == N:
            return self.p_shard
        # a normal tensor also when first made under inference_mode (on CUDA this runs on the caller's thread):
        # training later reuses it and preserves its version counter, which inference tensors do not have
        with torch.inference_mode(False):
            return self._unshard()

    def _unshard(self) -> torch.Tensor:
        start = time.perf_counter()  # the storage is held (and grown) from here: memory counts it as unsharded
        if self.full is None:
            self.full = torch.empty(self.numel, dtype=self.param_dtype, device=self.device)
            if self.trainable:
                self.full.requires_grad_(True)
                self.full.register_post_accumulate_grad_hook(_weak(self._on_grad))
        elif self.full.untyped_storage().size() == 0:
            self.full.untyped_storage().resize_(self.numel * self.full.element_size())
        else:
            return self.full
        grown = time.perf_counter() - start
        whole = torch.empty(self.padded, dtype=self.param_dtype, device=self.device)
        self._gather_to_whole(self.p_shard, self.strategy.p, whole)
        # the re-gather before backward refills the storage that forward's saved views point to; keep the
        # version counter so autograd accepts it (as FSDP does)
        with self._unpack(whole, self.strategy.p, grown), torch.no_grad():
            with torch.autograd._unsafe_preserve_version_counter(self.full):
                self.from_blocks(whole, self.full.detach())
        return self.full

    def _unpack(self, whole: torch.Tensor, granularity: str, grown: float = 0.0) -> contextlib.AbstractContextManager:
        """The ledger's record (``Ledger.unpack``) of a copy-out of ``whole``, gathered from ``granularity``.

        None where no group took part (a level of one rank), as the cost model counts it.
        """
        g = self.groups
        if g.intra is None and (granularity != G or g.inter is None):
            return contextlib.nullcontext()
        return self.ledger.unpack(whole, grown)

    def reshard(self) -> None:
        """Frees the gathered buffer (p = I, G) and drops the modules' attributes that viewed it.

        The modules then see the sharded parameters again; autograd's saved views keep their metadata and see the
        storage again after the next unshard.
        """
        if self.strategy.p == N:
            return
        if self.full is not None and self.full.untyped_storage().size() > 0:
            self.full.untyped_storage().resize_(0)
        for slot in self.slots:
            for module, name in slot.targets:
                module.__dict__.pop(name, None)

    def full_freed(self) -> bool:
        """Whether the whole buffer was gathered before and is resharded now (p = I, G)."""
        return self.full is not None and self.strategy.p != N and self.full.untyped_storage().size() == 0

    def unsharded(self) -> bool:
        """Whether the gathered whole buffer is held now (p = I, G)."""
        return self.full is not None and self.strategy.p != N and self.full.untyped_storage().size() > 0

    def _gather_to_whole(self, shard: torch.Tensor, granularity: str, out: torch.Tensor) -> None:
        """Out (the whole blocked buffer) ← shard held at granularity: inter all-gather G→I, intra all-gather I→N."""
        g = self.groups
        out = out.detach()
        if granularity == N:
            out.copy_(shard)
            return
        if granularity == G:
            i_lo, i_hi = self.range(I)
            chunk = shard.new_empty(i_hi - i_lo)  # this rank's I-chunk
            _all_gather(chunk, shard, g.inter, self.ledger, "inter")
            shard = chunk
        _all_gather(out, shard, g.intra, self.ledger, "intra")  # puts this rank's own chunk in place too

    def views(self) -> list[torch.Tensor]:
        """The original parameters as views of the whole natural buffer (call after unshard).

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
        """One micro-step: reduces the natural-layout gradient to g's layout and accumulates it (spec §5.1).

        Nothing for g = N, an intra-group reduce-scatter for I, then an inter-group one for G. The engine runs
        it on its communication thread, so it overlaps the backward of the units before this one.
        """
        assert self.g_acc is not None
        if self.strategy.g == N:  # reduced at the boundary only (sync_grad)
            self.g_acc.add_(self.to_blocks(grad))
            return
        # in reduce_dtype, divided by n in two factors around the sums (as FSDP), so fp16 neither over- nor underflows
        x = self.to_blocks(grad.to(self.precision.reduce) / self._pre)
        x = reduce_scatter(x, self.rgroups.intra, self.rledger, "intra")
        if self.strategy.g == G:
            x = reduce_scatter(x, self.rgroups.inter, self.rledger, "inter")
        self.g_acc.add_(x / self._post)

    def sync_grad(self) -> bool:
        """Accumulation boundary: bring the accumulated gradients (already means over ranks) to os's layout.

        Returns whether it created the parameters' ``.grad`` (they were None).
        """
        assert self.g_acc is not None
        s, groups = self.strategy, self.rgroups
        x = self.g_acc.to(self.precision.reduce)  # collectives in reduce_dtype
        if s.g == N:  # local sums: the division by n, as in reduce
            x = x / self._pre
        if s.g == N:
            x = reduce_scatter(x, groups.intra, self.rledger, "intra")
        if s.g in (N, I):  # partial sums across groups
            if s.os == G:
                x = reduce_scatter(x, groups.inter, self.rledger, "inter")
            elif groups.inter is not None:
                x = x.clone()
                with self.rledger.call("all_reduce", "inter", groups.inter, x, passes=2):
                    dist.all_reduce(x, group=groups.inter)
        if s.os == N:  # NNN: reduce-scatter, all-reduce across groups, all-gather: a hierarchical all-reduce
            full = torch.empty(self.padded, dtype=x.dtype, device=self.device)
            _all_gather(full, x, groups.intra, self.rledger, "intra")
            x = full
        if s.g == N:
            x = x / self._post
        region = x.to(torch.float32, copy=True)
        created = all(p.grad is None for p in self.params)
        for p, local in zip(self.params, self._locals(region), strict=True):
            if p.grad is None:
                p.grad = DTensor.from_local(local, self.mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())  # fmt: skip
            else:  # synced on more than one micro-step (no no_sync): gradients add up, as with DDP
                p.grad.to_local().add_(local)
        self.g_acc.zero_()
        return created

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    # -- parameters after the optimizer step: os → p ----------------------------------------------------------
    def sync_params(self) -> None:
        """Brings the updated os shards back to p's layout: inter all-gather G→I, intra all-gather I→N."""
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
                    _all_gather(
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

    def full_values(self) -> torch.Tensor:
        """The whole natural buffer's current values (masters for trainable parameters), gathered on every rank."""
        dtype = torch.float32 if self.trainable else self.param_dtype
        out = torch.empty(self.numel, dtype=dtype, device=self.device)
        with torch.no_grad():
            if self._master_region is not None:
                shard, granularity = self._master_region.to(dtype), self.strategy.os
            else:
                shard, granularity = self.p_shard.detach(), self.strategy.p
            if granularity == N and self.level == N:
                return shard.clone()
            whole = torch.empty(self.padded, dtype=dtype, device=self.device)
            self._gather_to_whole(shard, granularity, whole)
            self.from_blocks(whole, out)
        return out

    def load_full(self, values: dict[int, torch.Tensor]) -> None:
        """Copies each given slot's whole value (by slot index) into this rank's shard of it; not collective.

        Call ``sync_params`` afterwards (on every rank) for trainable buffers.
        """
        block = self._my_block()
        with torch.no_grad():
            for i, v in values.items():
                s, (_, _, chunks), p = self.slots[i], self.places[i], self.params[i]
                start, rows = chunks[block]
                src = v.detach().reshape(s.shape)
                p.to_local().copy_(src if s.replicated else src[start : start + rows])

    def master_bytes(self) -> int:
        """Bytes of float32 masters held apart from the parameters (0 when they share the p-shard's storage)."""
        m = self._master_region
        if m is None or m.untyped_storage().data_ptr() == self.p_shard.untyped_storage().data_ptr():
            return 0
        return m.numel() * m.element_size()
