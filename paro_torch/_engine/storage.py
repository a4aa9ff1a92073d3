"""A buffer's storage: the p-shard it keeps, the masters the optimizer updates, the whole buffer for compute."""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from paro_torch import _C
from paro_torch._engine.collectives import Ledger, all_gather
from paro_torch._engine.layout import BufferLayout, G, I, N, ParamSlot
from paro_torch._groups import ParoGroups
from paro_torch._lanes import for_caller
from paro_torch.api import Precision


def weak_hook(method: Callable[..., None], *extra: object) -> Callable[[torch.Tensor], None]:
    """A tensor hook that calls ``method(tensor, *extra)`` while its object lives.

    A hook on a tensor that its own object holds must not hold the object: autograd keeps tensor hooks where
    Python's garbage collector cannot see the cycle, and the buffer (with its module) would never be freed.
    """
    ref = weakref.WeakMethod(method)

    def hook(t: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(t, *extra)

    return hook


def storage_dtype(precision: Precision, trainable: bool, values: list[torch.Tensor]) -> torch.dtype:
    """The dtype a buffer of these parameters is stored and gathered in (trainable: masters in ``precision.master``)."""
    if trainable:
        return precision.param
    return precision.frozen(functools.reduce(torch.promote_types, (v.dtype for v in values), values[0].dtype))


class BufferStorage(BufferLayout):
    """The tensors of one buffer: the p-shard, the masters (os), the gathered whole buffer (p = I, G).

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
        device: torch.device | None = None,
        received: tuple[int, torch.Tensor] | None = None,
    ) -> None:
        """Lays out ``values`` (each parameter's values), or ``received``.

        ``received``: (offset, the blocked values from there), a range holding this rank's p-shard and masters
        (see ``scatter_from_rank0`` in init.py); ``values`` are then unused.
        """
        device = device if device is not None else torch.device("cpu")
        super().__init__(slots, groups, mesh, strategy.os if trainable else strategy.p, device)
        self.ledger = Ledger()
        """Gathers and t_syncp (the gather lane)."""
        self.strategy = strategy
        self.trainable = trainable
        self.precision = precision
        self.param_dtype = param_dtype = storage_dtype(precision, trainable, values)
        """Compute and gathers (see [Note: mixed precision] in api.py); the masters' is ``precision.master``."""
        # each parameter's values, flat; only this rank's blocks are copied out of them (a meta-device model's
        # unit exists whole only as these)
        parts = [v.detach().reshape(-1) for v in values] if received is None else []

        def blocks(lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
            if received is None:
                return self._pack(parts, lo, hi, dtype)
            at, got = received
            return torch.empty(hi - lo, dtype=dtype, device=self.device).copy_(got[lo - at : hi - at])

        self.p_lo, self.p_hi = self.range(strategy.p)
        # p-shard: the persistent parameter storage (the whole natural layout when p = N)
        if strategy.p == N:
            self.p_shard = torch.zeros(self.numel, dtype=param_dtype, device=self.device)
            if received is None:
                for s, part in zip(slots, parts, strict=True):
                    self.p_shard[s.offset : s.offset + s.numel] = part
            else:
                self.from_blocks(blocks(0, self.padded, param_dtype), self.p_shard)
        else:
            self.p_shard = blocks(self.p_lo, self.p_hi, param_dtype)
        self.full: torch.Tensor | None = self.p_shard if strategy.p == N else None
        self._master_region: torch.Tensor | None = None
        self.params: list[nn.Parameter] = []
        """Per slot: this rank's shard as a DTensor parameter (os for trainable, p for frozen), original shape."""
        if trainable:
            shared = self._masters_in_p_shard()
            if shared is not None:  # the optimizer updates the parameters in place
                self._master_region = shared
            else:
                self._master_region = blocks(*self.range(strategy.os), precision.master)
            if strategy.p == N:
                self._grad_leaf(self.p_shard)
            self.params = [nn.Parameter(t, requires_grad=True) for t in self._dtensors(self._master_region)]
        else:
            self.params = [nn.Parameter(t, requires_grad=False) for t in self._dtensors(self.p_shard.detach())]
        self._local_views = [p._local_tensor for p in self.params]
        """Each parameter's shard as a view of the storage above (what ``adopt`` points it back at)."""
        self._call_leaves: dict[int, torch.Tensor] = {}
        """Calls after the first since the last backward: their leaves (see [Note: forwards before one backward])."""
        self._call_leaf: torch.Tensor | None = None
        """The leaf the modules' views come from now (None: ``full``, the first call's)."""

    def adopt(self) -> None:
        """Takes back the parameters after ``Module._apply`` (``.to``, ``.cpu``, ``.float``) swapped their tensors.

        A converted shard's values go into the storage, the parameter views the storage again, and a parameter
        object that ``_apply`` replaced is put back (the optimizer holds the original), as FSDP2's
        ``reset_sharded_param``. The conversion must keep the device and dtype (``ParoShardedModule._apply``).
        """
        for slot, param, view in zip(self.slots, self.params, self._local_views, strict=True):
            for module, name in slot.targets:
                now = module._parameters.get(name)
                if isinstance(now, DTensor) and now is not param:
                    param.grad = now.grad
                    local = now._local_tensor
                else:
                    local = param._local_tensor
                if local is not view:
                    with torch.no_grad():
                        view.copy_(local)
                module._parameters[name] = param
            param._local_tensor = view

    def retype(self, precision: Precision) -> None:
        """After ``Module._apply`` changed the parameters' dtype (``.double()``, ``.to(torch.bfloat16)``).

        The storage is converted (masters to ``precision.master``; the p-shard to the buffer's new storage dtype)
        and each parameter object takes a shard of it (``swap_tensors``, as ``_apply`` swaps DTensors), so the
        optimizer's references stay valid; gradients the user kept stay as ``_apply`` converted them.
        """
        s = self.strategy
        dtype = storage_dtype(precision, self.trainable, self.params)  # the parameters' dtypes are the new ones
        old_master = self._master_region
        self.precision, self.param_dtype = precision, dtype
        self.p_shard = self.p_shard.detach().to(dtype, copy=True)
        self.full = self.p_shard if s.p == N else None  # p = I, G: made again in the new dtype when gathered
        self.end_calls()
        region = self.p_shard.detach()
        if self.trainable:
            assert old_master is not None
            shared = self._masters_in_p_shard()
            if shared is not None:
                self._master_region = shared
                self._master_region.copy_(old_master)  # the masters lead the p-shard until t_syncp
            else:
                self._master_region = old_master.to(precision.master, copy=True)
            if s.p == N:
                self._grad_leaf(self.p_shard)
            region = self._master_region
        for param, fresh in zip(self.params, self._dtensors(region), strict=True):
            grad, param.grad = param.grad, None
            torch.utils.swap_tensors(param, nn.Parameter(fresh, requires_grad=param.requires_grad))
            param.grad = grad
        self._local_views = [p._local_tensor for p in self.params]

    def _masters_in_p_shard(self) -> torch.Tensor | None:
        """The masters as a view of the p-shard where they can be one (else None).

        They can where they are stored in the parameters' dtype and the os block is part of the p-shard: p = N keeps
        the natural layout, which holds no os block unless os = N.
        """
        s = self.strategy
        if self.param_dtype != self.precision.master or s.p == N and s.os != N:
            return None
        lo, hi = self.range(s.os)
        return self.p_shard.detach()[lo - self.p_lo : hi - self.p_lo]

    def _whole(self) -> torch.Tensor:
        """The whole natural buffer: the gathered one (p = I, G) or the p-shard (p = N)."""
        return self.full if self.full is not None else self.p_shard

    def _grad_leaf(self, whole: torch.Tensor, call: int = 0) -> None:
        """Makes the whole natural buffer the leaf autograd accumulates the unit's gradient into."""
        whole.requires_grad_(True)
        whole.register_post_accumulate_grad_hook(weak_hook(self._on_grad, call))

    def _on_grad(self, leaf: torch.Tensor, call: int) -> None:
        raise NotImplementedError  # the gradient schedule's (FlatBuffer)

    def begin_call(self, call: int) -> None:
        """Where the modules' views come from in a forward with grad: the call's leaf.

        Call 0's is ``full``; a later call's is a leaf of its own on the same storage (trainable, p = I, G; see
        [Note: forwards before one backward] in reducer.py).
        """
        if not self.trainable or self.strategy.p == N:
            return
        if call == 0:
            self._call_leaf = None
            return
        leaf = self._call_leaves.get(call)
        if leaf is None:
            assert self.full is not None, "unshard before begin_call"
            leaf = self._call_leaves[call] = self.full.detach()
            self._grad_leaf(leaf, call)
        self._call_leaf = leaf

    def grad_leaves(self) -> list[tuple[int, torch.Tensor]]:
        """(call, leaf) for every call's leaf that autograd may accumulate this buffer's gradient into."""
        first = self._whole()
        out = [(0, first)] if first.requires_grad else []
        return out + list(self._call_leaves.items())

    def end_calls(self) -> None:
        """After a backward that reduced: the next forward is a first call again."""
        self._call_leaves.clear()
        self._call_leaf = None

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
        with for_caller():  # compute reads and frees it (see [Note: memory across streams] in _lanes.py)
            if self.full is None:
                self.full = torch.empty(self.numel, dtype=self.param_dtype, device=self.device)
                if self.trainable:
                    self._grad_leaf(self.full)
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
            all_gather(chunk, shard, g.inter, self.ledger, "inter")
            shard = chunk
        all_gather(out, shard, g.intra, self.ledger, "intra")  # puts this rank's own chunk in place too

    def views(self) -> list[torch.Tensor]:
        """The original parameters as views of the whole natural buffer (call after unshard).

        One ``split`` rather than a slice per parameter: autograd then builds the buffer's gradient with one
        concatenation, where slices would each materialise a whole-buffer gradient to be summed.
        """
        full = self._call_leaf if self._call_leaf is not None else self._whole()
        parts = full.split(self._split_sizes)
        return [part.view(s.shape) for part, s in zip(parts, self.slots, strict=False)]

    # -- whole values, for state dicts ---------------------------------------------------------------------------
    def full_values(self) -> torch.Tensor:
        """The whole natural buffer's current values (masters for trainable parameters), gathered on every rank."""
        dtype = self.precision.master if self.trainable else self.param_dtype
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
        """Bytes of masters held apart from the parameters (0 when they share the p-shard's storage)."""
        m = self._master_region
        if m is None or m.untyped_storage().data_ptr() == self.p_shard.untyped_storage().data_ptr():
            return 0
        return m.numel() * m.element_size()
