"""``ParoShardedModule``: PaRO-DP, one engine for all 14 (p, g, os) strategies.

The public face: arguments, public methods and ``_apply``. The engine's jobs live in ``paro_torch._engine``
(units, initialisation, planning, the gather schedule, the reducer, buffer sync, state dicts, stats).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from paro_torch import _C
from paro_torch._comms import engine_comms
from paro_torch._engine import state_dict as _state_dict
from paro_torch._engine import stats
from paro_torch._engine.engine import Engine
from paro_torch._engine.init import build_units, probe_problem, requested_group_size, validate_everywhere
from paro_torch._engine.planning import cost_blocks, plan_strategy
from paro_torch._engine.units import WrapPolicy, assign_units
from paro_torch._groups import ParoGroups, build_groups
from paro_torch.api import Precision, model_dtype
from paro_torch.auto import LinkCalibration

__all__ = ["ParoShardedModule", "WrapPolicy"]

_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ParoShardedModule]] = weakref.WeakKeyDictionary()
"""Each wrapped module's ParoShardedModule (``ParoShardedModule.of``)."""


class ParoShardedModule(nn.Module):
    """Wraps a module for PaRO-DP training with strategy (p, g, os).

    Args:
        module: The model. Parameters must be floating point; they are moved into flat buffers.
        strategy: A code ("IIG", "PaRO-NIG"), an alias ("zero3", "hsdp", "ddp", ...) or "auto": measure the
            links, and take the fastest strategy that fits ``memory_budget`` per the cost model.
        group_size: Ranks per group; default PARO_GROUP_SIZE, else torchrun's LOCAL_WORLD_SIZE, else all.
        process_groups: An ``(intra, inter)`` pair of process groups instead of ``group_size``.
        device_mesh: A 2-D mesh (inter, intra) instead of ``group_size``.
        wrap_policy: Module classes (or a predicate) whose instances become units, each with its own buffers.
        mixed_precision: FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` for compute and gathers,
            ``reduce_dtype`` (default ``param_dtype``) for gradient collectives, ``output_dtype`` for the outputs,
            ``cast_forward_inputs``. As with FSDP2, the sharded parameters (the optimizer's masters), their
            gradients and their accumulation keep the model's dtype; without a policy the model computes in it too.
        memory_budget: Bytes per rank for model states (auto, and a check for an explicit strategy, also made
            with the default when link figures are given); default: the GPU's free memory, or the host's memory
            shared by one group's ranks.
        grad_accum: Micro-steps per optimizer step, for the cost model.
        clips_grad_norm: Whether each step calls ``clip_grad_norm_``, for the cost model (its all-reduce).
        tokens_per_micro_step: Tokens (batch x sequence) one rank processes per micro-step, for the cost model:
            with it, auto's predicted step includes the compute that hides communication.
        activation_checkpointing: Whether the units recompute their activations in backward, for the cost model;
            default: the model says so (Hugging Face's ``is_gradient_checkpointing``, or ``checkpoint_wrapper``).
        calibration: Link and throughput figures (a LinkCalibration or a JSON path; also PARO_CALIBRATION) for
            auto, or for an explicit strategy's ``plan`` (its predicted step and memory).
        example_inputs: One micro-batch (a dict of keyword arguments, a tuple or a tensor) on ``device``, with
            ``tokens_per_micro_step``: the cost model's plan (auto's, or ``plan`` for an explicit strategy) times
            the model's own forward and backward on it (alone and beside each level's gathers) and AdamW on its
            parameters' shapes, on every rank at once before sharding, for the compute and optimizer throughputs and
            the overlaps (instead of the probe's MLP block and flat tensor, or the calibration's figures). The model
            must be materialised on ``device``; one whose whole parameters and gradients exceed ``memory_budget`` is
            not timed (a warning says so) and the stand-in figures plan it.
        sync_module_states: Broadcast rank 0's parameters and buffers (as DDP does; unit by unit), so that ranks
            that built the model with different seeds train one model.
        broadcast_buffers: Before each training forward, make the buffers (e.g. BatchNorm statistics) rank 0's,
            as DDP's ``broadcast_buffers`` does; after the first step only those that some rank changed in the step
            before (see [Note: buffer broadcast]).
        device: Where parameters, gradients and buffers live (default: the CPU).
        param_init_fn: For a model built on the meta device (``with torch.device("meta"):``): initialises one
            module whose tensors were just materialised on ``device``; default its ``reset_parameters()``. Units
            are materialised, initialised and sharded one at a time (inner blocks first, the root last).

    Raises:
        InvalidStrategyError: unknown or eliminated strategy. TopologyError: sizes that do not fit.
        ValueError: ranks that disagree on the configuration, or unsupported parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        strategy: str = "IIG",
        *,
        group_size: int | None = None,
        process_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        device_mesh: DeviceMesh | None = None,
        wrap_policy: WrapPolicy = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        memory_budget: int | None = None,
        grad_accum: int = 1,
        clips_grad_norm: bool = False,
        tokens_per_micro_step: int | None = None,
        activation_checkpointing: bool | None = None,
        calibration: LinkCalibration | str | None = None,
        example_inputs: Any = None,
        sync_module_states: bool = True,
        broadcast_buffers: bool = True,
        device: torch.device | str | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        super().__init__()
        self.precision = Precision.of(mixed_precision, model_dtype(module.parameters()))
        self.param_dtype = self.precision.param
        """The trainable parameters' compute dtype (``param_dtype``, else the model's)."""
        m = requested_group_size(group_size, process_groups, device_mesh)
        parsed = validate_everywhere(
            module,
            strategy,
            m,
            self.param_dtype,
            example_inputs is not None,
            probe_problem(module, example_inputs, tokens_per_micro_step, device),
        )
        self.groups: ParoGroups = build_groups(m, process_groups, device_mesh)
        # [Note: a transparent wrapper] The wrapper shares the module's children, parameters and buffers (their
        # dicts), so that names, traversal and state dicts are the module's own, as after FSDP2's fully_shard:
        # named_parameters() and DCP's get_state_dict see "layers.0.weight", not "module.layers.0.weight". The
        # module itself is an attribute, not a child.
        self.__dict__["module"] = module
        self.__dict__["_modules"] = module._modules
        self.__dict__["_parameters"] = module._parameters
        self.__dict__["_buffers"] = module._buffers
        self.__dict__["_non_persistent_buffers_set"] = module._non_persistent_buffers_set
        self.device = _resolve_device(device)
        assignments = assign_units(module, wrap_policy)
        self.cost_blocks = cost_blocks([a[1] for a in assignments], self.groups)
        """The units as the cost model sees them (sizes and padded sizes per granularity)."""
        planned = plan_strategy(
            module,
            parsed,
            self.cost_blocks,
            self.groups,
            self.device,
            self.precision,
            memory_budget=memory_budget,
            grad_accum=grad_accum,
            clips_grad_norm=clips_grad_norm,
            tokens_per_micro_step=tokens_per_micro_step,
            activation_checkpointing=activation_checkpointing,
            calibration=calibration,
            example_inputs=example_inputs,
        )
        self.strategy: _C.Strategy = planned.strategy
        self.plan: dict[str, Any] | None = planned.plan
        """The cost model's report behind ``strategy="auto"`` (every strategy's memory, bytes, time)."""
        self.links: LinkCalibration | None = planned.links
        """The link and throughput figures the plan used."""
        comms = engine_comms(self.groups, self.device)  # see [Note: shared lanes] in _comms.py
        self.mesh = comms.mesh
        """The (intra, inter) mesh of the sharded parameters (DTensors); its groups serve DTensor ops only."""
        self.startup_received = {"intra": 0, "inter": 0, "whole": 0}
        """Bytes of rank 0's values this rank received at construction, per level (see [Note: start-up scatter])."""
        units = build_units(
            assignments,
            self.strategy,
            comms.gather_groups,
            self.mesh,
            self.precision,
            comms.reduce_groups,
            self.device,
            sync_module_states,
            param_init_fn,
            self.startup_received,
        )
        self.__dict__["_engine"] = Engine(
            module, units, self.strategy, comms, self.precision, self.device, broadcast_buffers
        )
        _WRAPPERS[module] = weakref.ref(self)
        _route_apply(module)

    @staticmethod
    def of(module: nn.Module) -> ParoShardedModule | None:
        """The ParoShardedModule that wraps ``module`` (whose parameters are now its shards), if any."""
        ref = _WRAPPERS.get(module)
        return ref() if ref is not None else None

    @property
    def _flat_buffers(self) -> list[Any]:
        return self._engine.flat_buffers

    @property
    def prefetches(self) -> int:
        """Parameter gathers started ahead of their unit's forward or backward (for tests and profiling)."""
        return self._engine.schedule.prefetches

    @property
    def overlapped_syncs(self) -> int:
        """Boundary gradient syncs queued during backward, as each buffer's gradient completed (ditto)."""
        return self._engine.reducer.overlapped_syncs

    @property
    def peak_unsharded(self) -> dict[str, int]:
        """Most units holding gathered parameters at once (p = I, G), seen when a unit's parameters are acquired."""
        return self._engine.schedule.peak_unsharded

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ParoShardedModule:
        """``Module._apply`` (``.to``, ``.cpu``, ``.float``, ``.double``, ...) that keeps the engine's storage.

        As FSDP2 re-derives its shards after ``_apply``: a dtype change converts the shards (the model's dtype, see
        [Note: mixed precision] in api.py; a ``param_dtype`` policy stays as it is) and the parameter objects the
        optimizer holds take the converted storage; any other conversion that keeps device and dtype runs as usual
        (buffers too) and the engine takes the parameters back (``FlatBuffer.adopt``). A device change raises
        before it touches anything: the storage and communicators are set at construction (``device=``).
        """
        master = self.precision.master
        probe = fn(torch.empty(0, dtype=master, device=self.device))
        if isinstance(probe, torch.Tensor) and probe.device != self.device:
            raise ValueError(
                f"ParoShardedModule: this conversion would move its parameters to {probe.device}; a wrapped model "
                f"lives on {self.device}: build it with device=..., or move the model before wrapping it"
            )
        retype = isinstance(probe, torch.Tensor) and probe.dtype != master
        engine = self.__dict__.get("_engine")
        if engine is None:  # during construction
            return super()._apply(fn, recurse)
        engine.settle()
        super()._apply(fn, recurse)
        if retype:
            self.precision = self.precision.retyped(probe.dtype)
            self.param_dtype = self.precision.param
            engine.retype(self.precision)
        for b in engine.flat_buffers:
            b.adopt()
        engine.buffer_sync.rebind(list(self.module.buffers()))
        return self

    # ----------------------------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the module, bringing each unit's parameters up to date on the gather lane ahead of it.

        After an optimizer step, each unit's t_syncp (and for p = I, G its gather) overlaps the forward of the
        units before it: one unit ahead for p = I, G; all queued at once for p = N, where that costs no memory.
        The work is done by hooks on the wrapped module (see [Note: the root session] in _engine/engine.py).
        """
        with self._engine.outermost_call():
            return self.module(*args, **kwargs)

    # ----------------------------------------------------------------------------------------- training API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without the boundary sync (as DDP/FSDP ``no_sync``)."""
        reducer = self._engine.reducer
        prev = reducer.sync_gradients
        reducer.sync_gradients = False
        try:
            yield
        finally:
            reducer.sync_gradients = prev

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """FSDP2's name for toggling the boundary sync."""
        self._engine.reducer.sync_gradients = requires

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the sharded parameters (the global norm); returns it, whole."""
        if math.isinf(norm_type):  # torch's max of an empty shard raises, on those ranks only: max of the others
            return self._clip_grad_max_(max_norm)
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _clip_grad_max_(self, max_norm: float) -> torch.Tensor:
        """``clip_grad_norm_`` with the infinity norm: the largest |gradient| over the ranks' shards."""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.parameters()
                 if p.grad is not None]  # fmt: skip
        maxima = [g.detach().abs().max().float() for g in grads if g.numel() > 0]
        norm = torch.stack(maxima).max() if maxima else torch.zeros((), device=self.device)
        for dim in range(self.mesh.ndim):  # as DTensor reduces the norm: over each dimension of the mesh
            dist.all_reduce(norm, dist.ReduceOp.MAX, group=self.mesh.get_group(dim))
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    # ------------------------------------------------------------------------------- names and state dicts
    def __getattr__(self, name: str) -> Any:
        """Attributes of the wrapped module (``model.config``, ``model.layers``), as FSDP1's wrapper forwards them.

        With ``named_parameters()`` under the inner module's names, this lets name-based tools (DCP's
        ``get_state_dict``) walk from the wrapper to each parameter.
        """
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("module")
            if inner is None:
                raise
            value = getattr(inner, name)
            if name == "generate" and callable(value):  # Hugging Face's: in a root session
                return functools.partial(self._engine.in_root_session, value)
            return value

    def train(self, mode: bool = True) -> ParoShardedModule:
        """Sets training mode on the wrapped module too (it is not a child: see [Note: a transparent wrapper])."""
        super().train(mode)
        self.module.train(mode)
        return self

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """This rank's state under the model's own names: sharded parameters (DTensors) and buffers; not collective.

        As FSDP2's. ``full_state_dict()`` gathers whole tensors; ``paro_torch.checkpoint`` (or DCP's
        ``get_state_dict``) saves and reshards it.
        """
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter whole (masters for trainable ones) and every buffer, under its original name.

        Call on every rank. With ``rank0_only`` the other ranks return an empty dict and hold one buffer at a
        time while gathering (as FSDP's ``rank0_only``), for saving models that do not fit one rank twice.
        """
        return _state_dict.full_state_dict(self._engine, rank0_only)

    def rank0_module_state(self) -> dict[str, Any]:
        """The wrapped module's own state (buffers such as BatchNorm statistics, extra state), rank 0's; collective.

        Copies: each rank's statistics saw its own batch in the last forward, and rank 0's stand for the model, as
        with DDP's ``broadcast_buffers``. (Parameters are the engine's: not in it.)
        """
        return _state_dict.rank0_module_state(self._engine)

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> tuple[list[str], list[str]]:
        """Loads whole parameters and buffers (as ``full_state_dict`` returns them); call on every rank alike.

        Each rank copies the rows it holds, then the parameters are synced from the masters. DTensor values (a
        ``state_dict()`` of another layout) are gathered whole first. With ``strict=False`` missing entries keep
        their values and unknown names are ignored. Returns the missing and the unexpected names.
        """
        return _state_dict.load_full_state_dict(self._engine, state_dict, strict)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Loads a state dict with the model's own names (see ``load_full_state_dict``); ``assign`` is not supported."""
        if assign:
            raise ValueError("ParoShardedModule.load_state_dict does not support assign=True")
        missing, unexpected = self.load_full_state_dict(dict(state_dict), strict)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def summon_full_params(
        self, rank0_only: bool = False
    ) -> contextlib.AbstractContextManager[dict[str, torch.Tensor]]:
        """Gives the wrapped module real, whole parameters (read-only copies) for the duration; collective.

        For code that reads the inner module's parameters, e.g. ``save_pretrained``. Yields the full state dict
        (empty on ranks other than 0 with ``rank0_only``, whose modules stay as they are). Changes to the
        parameters inside are not written back.
        """
        return _state_dict.summon_full_params(self._engine, rank0_only)

    # ------------------------------------------------------------------------------------------------ stats
    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sent per level ("intra", "inter") in the engine's collectives since the last reset.

        Nominal: each collective counted by the ring formula ((k - 1)/k of the buffer per pass, as the cost model
        counts it), not measured on the wire; the ``paro`` backend's ``comm_stats`` measures its own groups.
        """
        return stats.comm_bytes(self._flat_buffers)

    def unpacked_bytes(self) -> int:
        """Bytes this rank copied out of gathered parameter buffers into natural storage since the last reset.

        Local work, not traffic: after each gather for compute (p = I, G) and t_syncp's gather at p = N; the cost
        model's ``unpacked_bytes``, priced at the probed ``unpack_bandwidth``.
        """
        return stats.unpacked_bytes(self._flat_buffers)

    def comm_seconds(self) -> dict[str, float]:
        """Wall seconds this rank's communication lanes spent in each kind of collective since the last reset.

        Keyed "<collective> <level>" (e.g. "reduce_scatter inter"), from each call to its return, waits for late
        peers included, and "unpack local" for the copy-outs after gathers (``unpacked_bytes``): where a step's
        communication goes, beside the cost model's ``collectives`` rows. CPU only (Gloo calls return when done);
        empty on CUDA, where calls return once queued.
        """
        return stats.comm_seconds(self._flat_buffers)

    def reset_comm_bytes(self) -> None:
        """Zeroes the counters of ``comm_bytes``, ``unpacked_bytes`` and ``comm_seconds``."""
        stats.reset(self._flat_buffers)

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds persistently for parameters, gradient accumulators and optimizer states.

        Optimizer states count this rank's chunks (``torch.chunk``'s split gives rank 0 the largest: the cost
        model's figure); masters held apart from the parameters count with them.
        """
        return stats.memory_stats(self._flat_buffers, optimizer)


# [Note: conversions of the wrapped module] ``.to()``, ``.double()``, ``.cpu()`` called on the wrapped module itself
# (Hugging Face's ``model.to(device)`` on the inner model, Lightning's conversions of its LightningModule) must reach
# ParoShardedModule._apply, or they would swap new tensors into the parameters that the engine no longer updates. As
# FSDP2 swaps the class of each module it shards, the wrapped module's class becomes a subclass (same name) whose
# ``_apply`` defers to the wrapper's.
class _RoutedApply(nn.Module):
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        wrapper = ParoShardedModule.of(self)
        if wrapper is None:
            return super()._apply(fn, recurse)
        wrapper._apply(fn, recurse)
        return self


_ROUTED: dict[type, type] = {}


def _route_apply(module: nn.Module) -> None:
    """Swaps ``module``'s class for one whose ``_apply`` reaches the wrapper (see the note above)."""
    cls = type(module)
    if issubclass(cls, _RoutedApply):
        return
    if cls not in _ROUTED:
        _ROUTED[cls] = type(cls.__name__, (_RoutedApply, cls), {"__qualname__": cls.__qualname__,
                                                                 "__module__": cls.__module__})  # fmt: skip
    module.__class__ = _ROUTED[cls]


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """The device as tensors on it report theirs: the CPU without an index ("cpu:0" is "cpu"), an accelerator with."""
    d = torch.device(device) if device is not None else torch.device("cpu")
    if d.type == "cpu":
        return torch.device("cpu")
    if d.index is None and d.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return d
