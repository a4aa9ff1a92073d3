"""``ParoShardedModule``: PaRO-DP, one engine for all 14 (p, g, os) strategies.

[Note: dataflow] Per unit (a wrapped block, or the root's remaining parameters) and per micro-step:
unshard (gather p → N) before forward and again before backward when p is I or G, reshard after each; the
whole-buffer gradient is reduced to g's layout and accumulated (nothing for N, intra reduce-scatter for I,
plus inter reduce-scatter for G). At the accumulation boundary (the backward run with gradient sync on) each
buffer's accumulated gradient goes to os's layout (t_syncg) right after its last reduction, still during
backward, and becomes the master shard's ``.grad``; the user's optimizer updates only that shard; the next
forward brings each unit's update back to p's layout (t_syncp) just ahead of the unit, on the comm thread.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_map_only

from paro_torch import _C
from paro_torch._agree import raise_together
from paro_torch._backend import check_node_layout, resolve_group_size
from paro_torch._comms import engine_comms
from paro_torch._flat import FlatBuffer, G, I, Ledger, N, ParamSlot, param_rows
from paro_torch._groups import ParoGroups, build_groups
from paro_torch._lanes import Handle
from paro_torch._report import format_report
from paro_torch.api import Precision
from paro_torch.auto import (
    LinkCalibration,
    choose_strategy,
    default_memory_budget,
    estimate,
    measure_links,
    model_flops,
    probe_model,
)

logger = logging.getLogger("paro_torch")

WrapPolicy = set[type[nn.Module]] | Callable[[nn.Module], bool] | None


_Entry = tuple[str, nn.Module, str, nn.Parameter]  # (fqn, owning module, attribute name, parameter)


_Assignment = tuple[nn.Module, list[_Entry], list[nn.Module]]
"""A unit's module, its parameters and its own modules (those of its subtree outside inner units)."""


def _assign_units(module: nn.Module, policy: WrapPolicy) -> list[_Assignment]:
    """Each unit's module, parameters and own modules: wrapped blocks (inner first), then the root with the rest."""

    def wraps(m: nn.Module) -> bool:
        if policy is None or m is module:
            return False
        return isinstance(m, tuple(policy)) if isinstance(policy, set) else bool(policy(m))

    owner: dict[int, nn.Module] = {}
    blocks: list[nn.Module] = [module]
    members: dict[int, dict[int, nn.Module]] = {}

    def visit(prefix: str, m: nn.Module, unit: nn.Module) -> None:
        members.setdefault(id(unit), {})[id(m)] = m
        for name, p in m.named_parameters(recurse=False):
            if owner.setdefault(id(p), unit) is not unit:
                raise ValueError(
                    f"parameter {prefix}{name} is shared between modules of different units; paro_torch shards "
                    "each parameter in one unit: keep the sharing modules in one unit (adjust wrap_policy) or untie it"
                )
        for name, child in m.named_children():
            inner = child if wraps(child) else unit
            if inner is child and all(b is not child for b in blocks):
                blocks.append(child)
            visit(prefix + name + ".", child, inner)

    visit("", module, module)
    by_unit: dict[int, list[_Entry]] = {id(b): [] for b in blocks}
    seen: set[tuple[int, str]] = set()
    for mod_name, m in module.named_modules(remove_duplicate=False):
        for name, p in list(m.named_parameters(recurse=False)):
            if (id(m), name) not in seen:  # a module reachable by two paths holds its parameters once
                seen.add((id(m), name))
                fqn = f"{mod_name}.{name}" if mod_name else name
                by_unit[id(owner[id(p)])].append((fqn, m, name, p))
    return [(b, by_unit[id(b)], list(members[id(b)].values())) for b in reversed(blocks)]


class TrainingState(enum.Enum):
    """Where a unit is in the step; hooks check it first (as FSDP2's ``TrainingState``).

    A forward hook that fires in ``PRE_BACKWARD`` is a recomputation (activation checkpointing): it neither
    prefetches nor reshards, since backward is about to use the parameters.
    """

    IDLE = enum.auto()
    """Not running; parameters resharded (p = I, G)."""
    FORWARD = enum.auto()
    """Its forward runs."""
    PRE_BACKWARD = enum.auto()
    """Unsharded for its backward (or a recomputation inside it)."""
    POST_BACKWARD = enum.auto()
    """Its gradients are complete and handed to the communication thread."""


class _Unit:
    """The parameters of one wrapped block: a trainable and a frozen flat buffer."""

    def __init__(self, index: int, module: nn.Module, buffers: list[FlatBuffer]) -> None:
        self.index = index
        """Position in the engine's units (reverse definition order, root last): its bit in per-unit flags."""
        self.module = module
        self.buffers = buffers
        self.state = TrainingState.IDLE
        self.needs_sync = False
        """The optimizer may have changed the masters: t_syncp before the next compute (set for every unit alike)."""

    def gather(self) -> None:
        """Brings the parameters up to date after an optimizer step (t_syncp), then unshards them."""
        for b in self.buffers:
            if self.needs_sync and b.trainable:
                b.sync_params()
            b.unshard()
        self.needs_sync = False

    def set_views(self) -> None:
        """Points the modules' attributes at whole parameters for compute (``named_parameters()`` keep the shards).

        An instance attribute shadows the module's ``_parameters`` entry (the sharded DTensor) until ``reshard``.
        """
        for b in self.buffers:
            b.unshard()
            with torch.enable_grad():  # views that require grad, also when made inside backward (recomputation)
                views = b.views()
            for slot, view in zip(b.slots, views, strict=False):
                for module, name in slot.targets:
                    module.__dict__[name] = view

    def reshard(self) -> None:
        """Frees gathered parameters (p = I, G); the modules' attributes fall back to the sharded parameters."""
        for b in self.buffers:
            b.reshard()

    def unsharded(self) -> bool:
        """Whether any of its buffers holds gathered parameters now."""
        return any(b.unsharded() for b in self.buffers)


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
            ``cast_forward_inputs``. Gradients accumulate in float32 (in ``reduce_dtype`` where it is set); masters
            and optimizer states stay float32.
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
            must be materialised on ``device`` and fit one unsharded step.
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
        self.precision = Precision.of(mixed_precision)
        param_dtype = self.precision.param
        m = _requested_group_size(group_size, process_groups, device_mesh)
        auto = strategy.strip().lower() == "auto"
        parsed = _validate_everywhere(
            module,
            strategy,
            m,
            param_dtype,
            example_inputs is not None,
            _probe_problem(module, example_inputs, tokens_per_micro_step, device),
        )
        self.groups: ParoGroups = build_groups(m, process_groups, device_mesh)
        self.param_dtype = param_dtype
        # [Note: a transparent wrapper] The wrapper shares the module's children, parameters and buffers (their
        # dicts), so that names, traversal and state dicts are the module's own, as after FSDP2's fully_shard:
        # named_parameters() and DCP's get_state_dict see "layers.0.weight", not "module.layers.0.weight". The
        # module itself is an attribute, not a child.
        self.__dict__["module"] = module
        self.__dict__["_modules"] = module._modules
        self.__dict__["_parameters"] = module._parameters
        self.__dict__["_buffers"] = module._buffers
        self.__dict__["_non_persistent_buffers_set"] = module._non_persistent_buffers_set
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        assignments = _assign_units(module, wrap_policy)
        self.cost_blocks = _cost_blocks([a[1] for a in assignments], self.groups)
        """The units as the cost model sees them (sizes and padded sizes per granularity)."""
        self.plan: dict[str, Any] | None = None
        """The cost model's report behind ``strategy="auto"`` (every strategy's memory, bytes, time)."""
        self.links: LinkCalibration | None = None
        """The link and throughput figures the plan used."""
        # an explicit strategy is planned (its memory checked against the budget, its step predicted) when it has a
        # budget or link figures; links are measured for auto (or a model probe) alone, and the plan's times mean
        # something only when link figures are given
        given = calibration is not None or bool(os.environ.get("PARO_CALIBRATION")) or example_inputs is not None
        if auto or memory_budget is not None or given:
            budget = memory_budget if memory_budget is not None else default_memory_budget(self.groups.group_size)
            links = (
                _links(calibration, self.groups, self.device, throughputs=example_inputs is None)
                if auto or given
                else LinkCalibration(1e10, 1e9, 1e-5, 1e-5)
            )
            checkpointing = _checkpointed(module) if activation_checkpointing is None else activation_checkpointing
            if example_inputs is not None:
                assert tokens_per_micro_step is not None  # checked by _probe_problem
                # counted as the probe runs: a Trainer turns checkpointing on after wrapping
                flops = model_flops(self.cost_blocks, self.groups, tokens_per_micro_step, _checkpointed(module))
                links = probe_model(links, self.groups, module, example_inputs, flops, self.device, dtype=param_dtype)
            self.links = links
            only = None if auto else parsed.code if parsed else None
            self.plan = estimate(
                self.cost_blocks,
                self.groups,
                links=links,
                memory_budget=budget,
                grad_accum=grad_accum,
                clip_grad_norm=clips_grad_norm,
                sizes=self.precision.bytes(),
                tokens_per_micro_step=tokens_per_micro_step,
                activation_checkpointing=checkpointing,
                only=only,
                shared_cores=self.device.type == "cpu",
            )
            code = choose_strategy(self.plan, self.groups, memory_budget=budget, only=only)
            if auto and self.groups.rank == 0:
                logger.info("paro: strategy='auto'\n%s", format_report(self.plan))
            parsed = _C.Strategy(code)
        assert parsed is not None
        self.strategy = parsed
        self._gather_ahead = parsed.gather_ahead
        """Units past the computing one whose gathers may be in flight: the cost model's rule (its IssuePolicy)."""
        comms = engine_comms(self.groups, self.device)  # see [Note: shared lanes] in _comms.py
        self.mesh = comms.mesh
        """The (intra, inter) mesh of the sharded parameters (DTensors); its groups serve DTensor ops only."""
        self._rgroups = comms.reduce_groups
        self._comms = comms  # its communicators are released at exit (see [Note: communicators at exit])
        self._units = self._build_units(assignments, sync_module_states, param_init_fn)
        self._buffers_to_sync = [b for b in module.buffers() if b.numel() > 0] if broadcast_buffers else []
        # [Note: buffer broadcast] DDP broadcasts every buffer before every training forward: a blocking global
        # collective per micro-step, for buffers that are mostly constants (rotary inv_freq). Here the first step
        # broadcasts all of them; each rank notes which buffers changed (their version counters) since the last
        # broadcast, the boundary's flags all-reduce agrees on it, and the next step broadcasts before each forward
        # those that changed on some rank (BatchNorm statistics: every step, as DDP). A buffer changed on one rank
        # between steps is rank 0's again from the step after the next.
        self._buffers_due = [True] * len(self._buffers_to_sync)
        self._buffer_versions = [b._version for b in self._buffers_to_sync]
        self._buffers_changed = [False] * len(self._buffers_to_sync)
        self._flat_buffers = [b for u in self._units for b in u.buffers]
        self._sync_gradients = True
        self._in_backward = False
        self._root_depth = 0
        """Entries into the root session now open (see [Note: the root session])."""
        # [Note: communication threads] Gathers (and t_syncp) run on one thread, reductions (and t_syncg) on
        # another, each on its own communicators, so that neither waits for the other and each one's sequence
        # of collectives is the same on every rank:
        # - gathers follow one fixed order per pass (forward: units in definition order, root first; backward:
        #   the reverse, over the units some rank needs in backward, agreed by a small all-reduce when forward
        #   ends). A unit needed out of order, or skipped on this rank, is gathered anyway at its place (and
        #   freed when the pass ends), so every rank gathers the same units in the same order, one ahead of
        #   the computation (prefetch); the root unit comes first in both, since it wraps the whole forward;
        # - reductions follow one fixed order too (see [Note: reduction order]).
        # On CUDA each is a stream instead of a thread (see [Note: lanes] in _lanes.py). Modules on the same groups
        # share both (see [Note: shared lanes] in _comms.py).
        self._gathers, self._reducer = comms.gathers, comms.reducer
        self._fwd_order = list(reversed(self._units))  # root first
        self._pass: list[_Unit] = []
        self._pass_pos: dict[_Unit, int] = {}
        self._pass_next = 0
        self._gathered: dict[_Unit, Handle[None]] = {}
        self._bwd_flags: list[tuple[torch.Tensor, Handle[Any]]] = []
        self._needs_bwd = torch.zeros(len(self._units), dtype=torch.int64, device=self.device)
        self._root_grad = False
        self.prefetches = 0
        """Parameter gathers started ahead of their unit's forward or backward (for tests and profiling)."""
        self.overlapped_syncs = 0
        """Boundary gradient syncs queued during backward, as each buffer's gradient completed (ditto)."""
        self.peak_unsharded = {"forward": 0, "backward": 0}
        """Most units holding gathered parameters at once (p = I, G), seen when a unit's parameters are acquired."""
        # [Note: reduction order] Reductions go out in one fixed order on every rank (units in reverse definition
        # order, which is backward order for a stack of blocks, root last), whatever order autograd completes
        # them in: a gradient that completes early waits for those before it. A buffer whose gradient never
        # came (its unit was skipped on this rank) is reduced as zeros when backward ends, so the result is the
        # mean over ranks with zeros where unused, as DDP's find_unused_parameters. Which buffers were used is
        # agreed at each boundary (one small all-reduce after the reductions): one unused on every rank keeps
        # its gradient None, as in single-process training.
        self._pending_reduce: list[Handle[Any]] = []
        self._reduce_order = [b for b in self._flat_buffers if b.trainable]
        self._reduce_index = {id(b): i for i, b in enumerate(self._reduce_order)}
        self._unit_of = {id(b): u for u in self._units for b in u.buffers}
        self._ready: dict[int, torch.Tensor | None] = {}
        self._next_reduce = 0
        self._used = torch.zeros(len(self._reduce_order), dtype=torch.int64, device=self.device)
        self._created_grad: set[int] = set()
        # [Note: parameter sync] t_syncp (masters -> parameters) runs before the first forward after every
        # boundary backward, for every unit on every rank alike, whatever the optimizer did: fused and
        # raw-pointer optimizers update the masters without a trace, and a step skipped on one rank only must
        # not change which collectives run. An optimizer step after that forward would leave the parameters
        # stale: it is detected and reported at the next boundary (see _end_backward).
        self._sync_params_next = False
        self._synced_since_boundary = False
        self._late_step = False
        self._param_names = {
            n for b in self._flat_buffers for s in b.slots for n in (s.fqn, *(a[2] for a in s.aliases))
        }
        master_ids = {id(p) for b in self._flat_buffers if b.trainable for p in b.params}
        me = weakref.ref(self)

        def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            owner = me()
            if owner is not None and owner._synced_since_boundary and _optimizes(optimizer, master_ids):
                owner._late_step = True

        self._step_hook = register_optimizer_step_post_hook(after_step)
        weakref.finalize(self, self._step_hook.remove)  # a global hook: it must not outlive the module
        for u in self._units:
            if u.module is not module:
                u.module.register_forward_pre_hook(self._make_pre_forward(u), prepend=True, with_kwargs=True)
                u.module.register_forward_hook(self._make_post_forward(u))
        # the root's work runs in hooks on the wrapped module itself, so that calling it directly (Hugging Face's
        # ``model.generate`` reaches the inner model's forward through __getattr__) syncs and gathers it too
        module.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._root_post_forward)

    # ------------------------------------------------------------------------------------------ construction
    def _build_units(
        self, assignments: list[_Assignment], sync: bool, init_fn: Callable[[nn.Module], None] | None
    ) -> list[_Unit]:
        """Shards unit by unit, so that no rank holds more than the shards and one whole unit.

        A unit on the meta device is materialised and initialised first; with ``sync`` it becomes rank 0's.
        """
        units = []
        for block, entries, members in assignments:
            if any(e[3].is_meta for e in entries) or any(b.is_meta for m in members for b in m.buffers(False)):
                _materialize(members, self.device, init_fn)
                entries = [(fqn, m, name, m._parameters[name]) for fqn, m, name, _ in entries]
            for m in members:  # buffers live on the parameters' device
                for name, b in m._buffers.items():
                    if b is not None and b.device != self.device:
                        m._buffers[name] = b.to(self.device)
            if sync:
                own = [b for m in members for b in m.buffers(False)]
                _broadcast_from_rank0([e[3] for e in entries] + own, self.groups.whole)
            buffers = []
            for trainable in (True, False):
                chosen = [e for e in entries if e[3].requires_grad == trainable]
                if not chosen:
                    continue
                slots: list[ParamSlot] = []
                values, offset, first = [], 0, {}
                for fqn, m, name, p in chosen:
                    if id(p) in first:  # tied: one slot, viewed under every name
                        first[id(p)].aliases.append((m, name, fqn))
                    else:
                        first[id(p)] = ParamSlot(m, name, fqn, p.shape, offset, p.numel())
                        slots.append(first[id(p)])
                        values.append(p.detach())
                        offset += p.numel()
                buffer = FlatBuffer(slots, values, self.strategy, self.groups, self.mesh, trainable, self.precision,
                                    self._grad_ready, reduce_groups=self._rgroups, device=self.device)  # fmt: skip
                for slot, param in zip(slots, buffer.params, strict=True):
                    for m, name in slot.targets:
                        m._parameters[name] = param  # the shard, under the parameter's own name
                buffers.append(buffer)
            units.append(_Unit(len(units), block, buffers))
        return units

    # ------------------------------------------------------------------------------------------------- hooks
    @staticmethod
    def _in_autograd() -> bool:
        """True while autograd runs a backward (a forward now is a recomputation for activation checkpointing)."""
        return torch._C._current_graph_task_id() != -1

    def _begin_pass(self, order: list[_Unit]) -> None:
        self._pass, self._pass_next = order, 0
        self._pass_pos = {u: i for i, u in enumerate(order)}

    def _gather_due(self, unit: _Unit) -> bool:
        """Whether the unit has communication to run before it computes: a gather (p = I, G) or a t_syncp."""
        return self.strategy.p != N or unit.needs_sync

    def _submit_through(self, i: int) -> None:
        """Queues the gathers of the pass's units up to index ``i``, in order (see [Note: communication threads])."""
        while self._pass_next <= min(i, len(self._pass) - 1):
            u = self._pass[self._pass_next]
            self._pass_next += 1
            if self._gather_due(u) and u not in self._gathered:
                self._gathered[u] = self._gathers.submit(u.gather)

    def _acquire(self, unit: _Unit, prefetch: bool = True) -> None:
        """Makes the unit's parameters available now, queuing the gathers due before it and the next one."""
        i = self._pass_pos.get(unit)
        if i is None or i < self._pass_next and unit not in self._gathered:
            # outside the pass (e.g. a unit run twice in a forward): a gather of its own, as on every rank
            if self._gather_due(unit) or any(b.full_freed() for b in unit.buffers):
                self._gathers.submit(unit.gather).result()
                self._gathers.hand_over(b.full for b in unit.buffers if b.full is not None)
            return
        self._submit_through(i)
        pending = self._gathered.pop(unit, None)
        if prefetch and self._pass_next < len(self._pass):
            before = len(self._gathered)
            ahead = len(self._pass) if self._gather_ahead is None else self._gather_ahead
            self._submit_through(i + ahead)
            self.prefetches += len(self._gathered) - before
        if pending is not None:
            pending.result()
            self._gathers.hand_over(b.full for b in unit.buffers if b.full is not None)
        if self.strategy.p != N:
            phase = "backward" if self._in_backward else "forward"
            held = sum(u.unsharded() for u in self._units)
            self.peak_unsharded[phase] = max(self.peak_unsharded[phase], held)

    def _end_pass(self) -> None:
        """Gathers what the pass has not (units skipped on this rank), waits for every gather, reshards the rest."""
        self._submit_through(len(self._pass) - 1)
        for unit, fut in self._gathered.items():
            fut.result()
            if self.strategy.p != N:
                unit.reshard()
        self._gathered.clear()
        self._begin_pass([])

    def _make_pre_forward(self, unit: _Unit) -> Callable[..., Any]:
        frozen = [b for b in unit.buffers if not b.trainable]

        def frozen_done() -> None:
            for b in frozen:
                b.reshard()

        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            self._unit_pre_forward(unit)
            if self.precision.cast_inputs:
                args, kwargs = _cast_floats((args, kwargs), self.precision.param)
            if frozen and self.strategy.p != N and torch.is_grad_enabled():
                # frozen parameters have no gradient hook to free them after the unit's backward: free them
                # once the gradients of the unit's inputs are complete (as FSDP2's post-backward); units whose
                # inputs need no gradient are freed when backward ends
                needs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
                if needs:
                    torch.autograd.graph.register_multi_grad_hook(needs, lambda _: frozen_done(), mode="all")
            return args, kwargs

        return hook

    def _unit_pre_forward(self, unit: _Unit) -> None:
        if self._in_autograd():  # recomputation: unshard if needed, no prefetch, stay unsharded
            self._unshard_for_backward(unit, prefetch=False)
            if torch.is_grad_enabled():  # the resharded unit's attributes fell back to the shards: views anew
                unit.set_views()
            return
        unit.state = TrainingState.FORWARD
        self._acquire(unit)
        unit.set_views()

    def _make_post_forward(self, unit: _Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._in_autograd():  # recomputation: backward is about to use the parameters
                return output
            if self.strategy.p != N:
                unit.reshard()
            unit.state = TrainingState.IDLE
            # reentrant checkpointing runs the unit without grad, and again in backward: it needs backward too
            if self._register_pre_backward(unit, output) or self._root_grad and not torch.is_grad_enabled():
                self._needs_bwd[unit.index] = 1
            return output

        return hook

    def _register_pre_backward(self, unit: _Unit, output: Any) -> bool:
        """Hooks the unit's gather for backward on its outputs; returns whether any requires grad."""
        if not torch.is_grad_enabled():
            return False

        def hook(grad: torch.Tensor) -> torch.Tensor:
            self._start_backward()
            self._unshard_for_backward(unit, prefetch=True)
            return grad

        outputs = [t for t in _tensors(output) if t.requires_grad]
        for t in outputs:
            t.register_hook(hook)
        return bool(outputs)

    def _unshard_for_backward(self, unit: _Unit, prefetch: bool) -> None:
        """Gathers the unit for its backward once per backward (its pre-backward hook or a recomputation)."""
        self._start_backward()
        if unit.state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD) and not any(
            b.full_freed() for b in unit.buffers
        ):
            return  # gathered for this backward already (a unit run twice may need its frozen part again)
        unit.state = TrainingState.PRE_BACKWARD
        self._acquire(unit, prefetch)
        # a recomputation inside the unit's own __call__ (Hugging Face's checkpointed layers) passes no hook of
        # ours: the modules must see whole parameters again before it
        unit.set_views()

    def _start_backward(self) -> None:
        """At the first hook of a backward: agree on the units it gathers, queue the end-of-backward callback."""
        if self._in_backward:
            return
        self._in_backward = True
        Variable._execution_engine.queue_callback(self._end_backward)
        if self.strategy.p == N:
            return
        needs = torch.zeros_like(self._needs_bwd)
        for flags, fut in self._bwd_flags:
            fut.result()
            needs |= flags
        self._bwd_flags.clear()
        # backward order: the root first (its output's hook fires first), then the blocks in reverse
        order = [self._units[-1], *self._units[:-1]]
        self._begin_pass([u for u in order if needs[u.index]])

    def _grad_ready(self, buffer: FlatBuffer, grad: torch.Tensor) -> None:
        """A buffer's gradient is complete: queue the reductions now due in the fixed order (Note: reduction order).

        They run on the reduction thread while the units before this one compute their backward; a g = N micro-step
        without sync only sums locally, which ``_flush_reductions`` does in place.
        """
        i = self._reduce_index[id(buffer)]
        if i in self._ready or i < self._next_reduce:
            raise RuntimeError(
                f"paro_torch: the gradient of the unit holding {buffer.slots[0].fqn} completed twice in one "
                "backward; a unit's parameters must reach the loss through one backward pass per micro-step"
            )
        self._used[i] = 1
        self._ready[i] = grad
        unit = self._unit_of[id(buffer)]
        if all(b.grad_ready or not b.trainable for b in unit.buffers):
            unit.state = TrainingState.POST_BACKWARD
        self._flush_reductions()

    def _flush_reductions(self) -> None:
        while self._next_reduce in self._ready:
            i = self._next_reduce
            grad = self._ready.pop(i)
            self._next_reduce += 1
            if self.strategy.g == N and not self._sync_gradients:
                # a local sum, no collective: here, not through the lane (on CPU a thread handoff per unit)
                self._reduce_and_sync(i, grad, sync=False)
                continue
            self._pending_reduce.append(self._reducer.submit(self._reduce_and_sync, i, grad, self._sync_gradients))
            self.overlapped_syncs += self._sync_gradients

    def _reduce_and_sync(self, i: int, grad: torch.Tensor | None, sync: bool) -> None:
        buffer = self._reduce_order[i]
        buffer.reduce(
            grad if grad is not None else torch.zeros(buffer.numel, dtype=buffer.param_dtype, device=buffer.device)
        )
        if sync and buffer.sync_grad():
            self._created_grad.add(i)

    def _finish_reductions(self) -> None:
        while self._pending_reduce:
            self._pending_reduce.pop(0).result()

    def _end_backward(self) -> None:
        """Runs once when autograd finishes: reduce unused buffers as zeros, agree on use at a boundary, reshard."""
        self._in_backward = False
        if self.strategy.p != N:
            self._end_pass()
        for i in range(self._next_reduce, len(self._reduce_order)):
            self._ready.setdefault(i, None)  # unused on this rank in this micro-step
        self._flush_reductions()
        self._next_reduce = 0
        if self._sync_gradients:
            self._note_buffer_changes()
        tail = torch.tensor([*self._buffers_changed, self._late_step], dtype=torch.int64, device=self.device)
        flags = torch.cat([self._used, tail])
        if self._sync_gradients:
            self._pending_reduce.append(self._reducer.submit(dist.all_reduce, flags, group=self._rgroups.whole))
        self._finish_reductions()
        self._reset_units()
        if not self._sync_gradients:
            return
        late, used = bool(flags[-1]), flags[: len(self._used)]
        self._buffers_due = [bool(c) for c in flags[len(self._used) : -1]]  # see [Note: buffer broadcast]
        self._buffers_changed = [False] * len(self._buffers_to_sync)
        for i in self._created_grad:
            if used[i] == 0:  # unused on every rank in this accumulation window: no gradient, as in one process
                self._reduce_order[i].clear_grads()
        self._created_grad.clear()
        self._used.zero_()
        self._sync_params_next = True
        self._synced_since_boundary = False
        self._late_step = False
        if late:
            raise RuntimeError(
                "paro_torch: optimizer.step() ran after a forward that followed the last gradient sync, so that "
                "forward synced the parameters before the step and the steps since used stale parameters; call "
                "optimizer.step() (and zero_grad()) before the next forward of the model"
            )

    def _note_buffer_changes(self) -> None:
        """Notes the buffers whose version changed since the last look (see [Note: buffer broadcast])."""
        for i, b in enumerate(self._buffers_to_sync):
            if b._version != self._buffer_versions[i]:
                self._buffers_changed[i] = True
                self._buffer_versions[i] = b._version

    def _reset_units(self) -> None:
        """Every unit idle and resharded (its modules' attributes back on the shards: no view of freed storage)."""
        for u in self._units:
            u.state = TrainingState.IDLE
            u.reshard()
            for b in u.buffers:
                b.grad_ready = False

    def _recover_from_failed_backward(self) -> None:
        """A forward after a backward that raised (autograd then skips its end callback): start clean.

        The gradients accumulated since the last boundary are dropped (the failed backward reduced some units'
        and not others'), on every rank alike when every rank failed alike; call ``zero_grad()`` and go on with
        the next batch, as after a failed backward in one process.
        """
        logger.warning(
            "paro_torch: the last backward did not finish (it raised); the gradients accumulated since the last "
            "optimizer step are dropped"
        )
        self._in_backward = False
        self._drop_pass()
        for handle in self._pending_reduce:
            with contextlib.suppress(Exception):  # a reduction that failed with the backward
                handle.result()
        self._pending_reduce.clear()
        self._ready.clear()
        self._next_reduce = 0
        self._bwd_flags.clear()
        self._reset_units()
        for b in self._reduce_order:
            if b.g_acc is not None:
                b.g_acc.zero_()
            b.clear_grads()  # a boundary sync of the failed backward may have created some after zero_grad()
        self._used.zero_()
        self._created_grad.clear()

    # ----------------------------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the module, bringing each unit's parameters up to date on the gather thread ahead of it.

        After an optimizer step, each unit's t_syncp (and for p = I, G its gather) overlaps the forward of the
        units before it: one unit ahead for p = I, G; all queued at once for p = N, where that costs no memory.
        The work is done by hooks on the wrapped module (see [Note: the root session]).
        """
        with self._outermost_call():
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def _outermost_call(self) -> Iterator[None]:
        """A call from outside the model: starts clean, and cleans up if it raises."""
        if self._root_depth:  # a direct call of the module raised before its end
            self._abort_forward()
        try:
            yield
        except BaseException:
            self._abort_forward()
            raise

    # [Note: the root session] The root unit is gathered, and the parameters synced after an optimizer step,
    # from the first entry into the wrapped module to the matching exit: its forward hooks (so that calling it
    # directly works too) or ``generate`` (which may reach the model through modules without our hooks, as
    # PEFT's does). Entries nested in a session do nothing: Lightning runs ``training_step`` inside the wrapped
    # module's forward, and it calls the module again.
    def _root_enter(self) -> None:
        self._root_depth += 1
        if self._root_depth > 1:
            return
        if self._in_backward and not self._in_autograd():
            self._recover_from_failed_backward()
        if self._sync_params_next:  # see [Note: parameter sync]
            self._sync_params_next = False
            self._synced_since_boundary = True
            for u in self._units:
                u.needs_sync = any(b.trainable for b in u.buffers)
        root = self._units[-1]
        if self._buffers_to_sync and self.module.training and torch.is_grad_enabled():
            self._note_buffer_changes()
            due = [b for b, d in zip(self._buffers_to_sync, self._buffers_due, strict=True) if d]
            if due:
                self._gathers.submit(_broadcast_from_rank0, due, self._comms.gather_world).result()
                self._buffer_versions = [b._version for b in self._buffers_to_sync]
        self._begin_pass(self._fwd_order)
        self._root_grad = torch.is_grad_enabled()
        self._needs_bwd.zero_()
        if self._gather_ahead is None:  # p = N: every unit's t_syncp now (see IssuePolicy in the cost model)
            self._submit_through(len(self._fwd_order) - 1)
            self.prefetches += len(self._gathered) - (root in self._gathered)
        root.state = TrainingState.FORWARD
        self._acquire(root)
        root.set_views()

    def _root_exit(self, out: Any) -> Any:
        if self.precision.output is not None:
            out = _cast_floats(out, self.precision.output)
        self._root_depth -= 1
        if self._root_depth > 0:
            return out
        root = self._units[-1]
        self._end_pass()
        if self.strategy.p != N:
            root.reshard()
        root.state = TrainingState.IDLE
        if self._register_pre_backward(root, out):
            self._needs_bwd[root.index] = 1
        if self._root_grad and self.strategy.p != N:  # agree on the units backward gathers
            flags = self._needs_bwd.clone()
            handle = self._gathers.submit(dist.all_reduce, flags, op=dist.ReduceOp.MAX, group=self._comms.gather_world)
            self._bwd_flags.append((flags, handle))
            if len(self._bwd_flags) > 4:  # forwards with grad and no backward (an evaluation without no_grad)
                folded = torch.zeros_like(flags)
                for f, handle in self._bwd_flags:
                    handle.result()
                    folded |= f
                done: Future[None] = Future()
                done.set_result(None)
                self._bwd_flags = [(folded, done)]
        return out

    def _root_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        self._root_enter()
        return _cast_floats((args, kwargs), self.precision.param) if self.precision.cast_inputs else None

    def _root_post_forward(self, module: nn.Module, args: Any, out: Any) -> Any:
        return self._root_exit(out)

    def _drop_pass(self) -> None:
        """Waits for the gathers the pass issued and frees them.

        It issues none of the rest (ranks that failed alike issued the same), so that a failure does not gather
        the whole model at once.
        """
        for fut in self._gathered.values():
            with contextlib.suppress(Exception):
                fut.result()
        self._gathered.clear()
        self._begin_pass([])

    def _abort_forward(self) -> None:
        """After a forward that raised: every unit idle and resharded.

        A unit that raised may still hold its gathered parameters, which the next sync would not refresh.
        """
        self._root_depth = 0
        self._drop_pass()
        self._reset_units()

    def _in_root_session(self, generate: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate`` (Hugging Face) in a root session (see [Note: the root session]).

        With p = I, G every forward gathers parameters on every rank, so ranks must run as many forwards:
        ``synced_gpus`` defaults to True then (as Hugging Face does for FSDP and ZeRO-3).
        """
        if self.strategy.p != N and self.groups.world > 1:
            kwargs.setdefault("synced_gpus", True)
        with self._outermost_call():
            self._root_enter()
            out = generate(*args, **kwargs)
            self._root_exit(None)
        return out

    # ----------------------------------------------------------------------------------------- training API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without the boundary sync (as DDP/FSDP ``no_sync``)."""
        prev = self._sync_gradients
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = prev

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """FSDP2's name for toggling the boundary sync."""
        self._sync_gradients = requires

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the sharded parameters (the global norm); returns it, whole."""
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

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
                return functools.partial(self._in_root_session, value)
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
        """Every parameter whole (masters in float32 for trainable ones) and every buffer, under its original name.

        Call on every rank. With ``rank0_only`` the other ranks return an empty dict and hold one buffer at a
        time while gathering (as FSDP's ``rank0_only``), for saving models that do not fit one rank twice.
        """
        out: dict[str, torch.Tensor] = {}
        keep = not rank0_only or self.groups.rank == 0
        own = self.rank0_module_state()
        if keep:
            out.update(own)
        for b in self._flat_buffers:
            values = b.full_values()
            if not keep:
                continue
            for s in b.slots:
                out[s.fqn] = values[s.offset : s.offset + s.numel].view(s.shape).clone()
                for _, _, alias in s.aliases:
                    out[alias] = out[s.fqn]
        return out

    def rank0_module_state(self) -> dict[str, Any]:
        """The wrapped module's own state (buffers such as BatchNorm statistics, extra state), rank 0's; collective.

        Copies: each rank's statistics saw its own batch in the last forward, and rank 0's stand for the model, as
        with DDP's ``broadcast_buffers``. (Parameters are the engine's: not in it.)
        """
        own = {k: v.detach().clone() if torch.is_tensor(v) else v
               for k, v in self.module.state_dict().items() if k not in self._param_names}  # fmt: skip
        _broadcast_from_rank0([v for v in own.values() if torch.is_tensor(v) and v.numel() > 0], self.groups.whole)
        return own

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> tuple[list[str], list[str]]:
        """Loads whole parameters and buffers (as ``full_state_dict`` returns them); call on every rank alike.

        Each rank copies the rows it holds, then the parameters are synced from the masters. DTensor values (a
        ``state_dict()`` of another layout) are gathered whole first. With ``strict=False`` missing entries keep
        their values and unknown names are ignored. Returns the missing and the unexpected names.
        """
        where = {n: (b, i) for b in self._flat_buffers for i, s in enumerate(b.slots) for n in s.names}
        shapes = {n: b.slots[i].shape for n, (b, i) in where.items()}
        own = {k for k in self.module.state_dict() if k not in where}
        primary = {s.fqn for b in self._flat_buffers for s in b.slots}
        missing = sorted((primary | own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(where) - own)
        differ = sorted(k for k in set(where) & set(state_dict) if tuple(state_dict[k].shape) != tuple(shapes[k]))
        if differ or (strict and (missing or unexpected)):
            raise ValueError(
                f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                f"other shapes {differ[:5]}; pass the full_state_dict() of the same model"
            )
        todo: dict[FlatBuffer, dict[int, torch.Tensor]] = {b: {} for b in self._flat_buffers}
        for k in sorted(set(where) & set(state_dict)):
            v = state_dict[k]
            b, i = where[k]
            mine = b.params[i]
            if isinstance(v, DTensor) and v.placements == mine.placements and v.device_mesh == mine.device_mesh:
                with torch.no_grad():  # this rank's shard already (e.g. from set_state_dict): no gather
                    mine.to_local().copy_(v.to_local())
            else:
                todo[b][i] = v.full_tensor() if isinstance(v, DTensor) else v
        for b, values in todo.items():
            b.load_full(values)
            if b.trainable:
                b.sync_params()
        rest = {k: v for k, v in state_dict.items() if k in own}
        if rest:
            self.module.load_state_dict(rest, strict=False)
        return missing, unexpected

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Loads a state dict with the model's own names (see ``load_full_state_dict``); ``assign`` is not supported."""
        if assign:
            raise ValueError("ParoShardedModule.load_state_dict does not support assign=True")
        missing, unexpected = self.load_full_state_dict(dict(state_dict), strict)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    @contextlib.contextmanager
    def summon_full_params(self, rank0_only: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Gives the wrapped module real, whole parameters (read-only copies) for the duration; collective.

        For code that reads the inner module's parameters, e.g. ``save_pretrained``. Yields the full state dict
        (empty on ranks other than 0 with ``rank0_only``, whose modules stay as they are). Changes to the
        parameters inside are not written back.
        """
        full = self.full_state_dict(rank0_only=rank0_only)
        places = [
            (m, name, s.fqn)
            for b in self._flat_buffers
            for s in b.slots
            for m, name in [(s.module, s.name), *[(a[0], a[1]) for a in s.aliases]]
        ] if full else []  # fmt: skip
        views = [m.__dict__.pop(name, None) for m, name, _ in places]  # the engine's views (see set_views)
        shards = [m._parameters[name] for m, name, _ in places]
        params = {fqn: nn.Parameter(full[fqn], requires_grad=False) for _, _, fqn in places}
        for m, name, fqn in places:
            m._parameters[name] = params[fqn]
        try:
            yield full
        finally:
            for (m, name, _), view, shard in zip(places, views, shards, strict=True):
                m._parameters[name] = shard
                if view is not None:
                    m.__dict__[name] = view

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sent per level ("intra", "inter") in the engine's collectives since the last reset.

        Nominal: each collective counted by the ring formula ((k - 1)/k of the buffer per pass, as the cost model
        counts it), not measured on the wire; the ``paro`` backend's ``comm_stats`` measures its own groups.
        """
        out = {"intra": 0, "inter": 0}
        for ledger in self._ledgers():
            for level in out:
                out[level] += ledger.sent[level]
        return out

    def unpacked_bytes(self) -> int:
        """Bytes this rank copied out of gathered parameter buffers into natural storage since the last reset.

        Local work, not traffic: after each gather for compute (p = I, G) and t_syncp's gather at p = N; the cost
        model's ``unpacked_bytes``, priced at the probed ``unpack_bandwidth``.
        """
        return sum(ledger.unpacked for ledger in self._ledgers())

    def comm_seconds(self) -> dict[str, float]:
        """Wall seconds this rank's communication threads spent in each kind of collective since the last reset.

        Keyed "<collective> <level>" (e.g. "reduce_scatter inter"), from each call to its return, waits for late
        peers included, and "unpack local" for the copy-outs after gathers (``unpacked_bytes``): where a step's
        communication goes, beside the cost model's ``collectives`` rows. CPU only (Gloo calls return when done);
        empty on CUDA, where calls return once queued.
        """
        out: dict[str, float] = {}
        for ledger in self._ledgers():
            for key, seconds in ledger.seconds.items():
                out[key] = out.get(key, 0.0) + seconds
        return out

    def reset_comm_bytes(self) -> None:
        """Zeroes the counters of ``comm_bytes``, ``unpacked_bytes`` and ``comm_seconds``."""
        for ledger in self._ledgers():
            ledger.reset()

    def _ledgers(self) -> Iterator[Ledger]:
        for b in self._flat_buffers:
            yield from (b.ledger, b.rledger)

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds persistently for parameters, gradient accumulators and optimizer states.

        Optimizer states count this rank's chunks (``torch.chunk``'s split gives rank 0 the largest: the cost
        model's figure); separate float32 masters count with them.
        """
        params = sum(b.p_shard.numel() * b.p_shard.element_size() for b in self._flat_buffers)
        grads = sum(b.g_acc.numel() * b.g_acc.element_size() for b in self._flat_buffers if b.g_acc is not None)
        optim = sum(b.master_bytes() for b in self._flat_buffers)
        if optimizer is not None:
            for b in self._flat_buffers:
                for p in b.params if b.trainable else []:
                    for name, v in optimizer.state.get(p, {}).items():
                        local = v.to_local() if isinstance(v, DTensor) else v
                        if torch.is_tensor(local) and name != "step":
                            optim += local.numel() * local.element_size()
        return {"params": params, "grads": grads, "optimizer_states": optim}


def _broadcast_from_rank0(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Makes the tensors equal to rank 0's (one broadcast per dtype)."""
    tensors = list({id(t): t for t in tensors}.values())
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=0, group=group)
        with torch.no_grad():
            for t, v in zip(same, flat.split([t.numel() for t in same]), strict=True):
                t.copy_(v.view_as(t))


def _materialize(members: list[nn.Module], device: torch.device, init_fn: Callable[[nn.Module], None] | None) -> None:
    """Gives a unit's modules real (uninitialised) tensors for their meta ones, then initialises each module.

    ``init_fn(module)`` (default: its ``reset_parameters()``, where it has one) runs once per module, in order.
    Tied parameters stay tied.
    """
    fresh: dict[int, nn.Parameter] = {}
    for m in members:
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in fresh:
                    fresh[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                m._parameters[name] = fresh[id(p)]
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)
    for m in members:
        if init_fn is not None:
            init_fn(m)
        elif callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()


def _checkpointed(module: nn.Module) -> bool:
    """Whether the model recomputes activations in backward: Hugging Face's flag or torch's checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return bool(getattr(module, "is_gradient_checkpointing", False)) or any(
        isinstance(m, CheckpointWrapper) for m in module.modules()
    )


def _cost_blocks(units: list[list[_Entry]], groups: ParoGroups) -> list[dict[str, Any]]:
    """Each unit's parameter counts and padded buffer sizes per granularity, for the cost model."""
    out = []
    for entries in units:
        unique = list({id(e[3]): e[3] for e in entries}.values())
        if not unique:
            continue
        padded: dict[str, list[int]] = {}
        for kind, trainable in (("trainable", True), ("frozen", False)):
            rows = [param_rows(p.shape) for p in unique if p.requires_grad == trainable]
            padded[kind] = [_C.RowLayout(rows, groups.world, groups.group_size, x).padded for x in (N, I, G)]
        numel = sum(p.numel() for p in unique)
        out.append({"numel": numel, "trainable": sum(p.numel() for p in unique if p.requires_grad), "padded": padded})
    return out


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """The tree with its floating-point tensors cast to ``dtype`` (as FSDP2 casts inputs and outputs)."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _optimizes(optimizer: torch.optim.Optimizer, master_ids: set[int]) -> bool:
    return any(id(p) in master_ids for group in optimizer.param_groups for p in group["params"])


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
    elif hasattr(x, "__dataclass_fields__") or hasattr(x, "to_tuple"):
        yield from _tensors(x.to_tuple() if hasattr(x, "to_tuple") else vars(x))


def _requested_group_size(
    group_size: int | None,
    process_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] | None,
    device_mesh: DeviceMesh | None,
) -> int:
    if device_mesh is not None:
        return device_mesh.size(device_mesh.ndim - 1)
    if process_groups is not None:
        return dist.get_world_size(process_groups[0]) if process_groups[0] is not None else 1
    return group_size if group_size is not None else resolve_group_size(dist.get_world_size())


def _probe_problem(module: nn.Module, example_inputs: Any, tokens: int | None, device: Any) -> str | None:
    """Why ``example_inputs`` cannot be timed on this rank (None: they can, or none were given)."""
    if example_inputs is None:
        return None
    if tokens is None:
        return "example_inputs needs tokens_per_micro_step (the tokens in that batch) to count its FLOPs"
    want = torch.device(device) if device is not None else torch.device("cpu")
    where = {p.device for p in module.parameters()}
    if any(d.type != want.type for d in where):
        return (f"example_inputs: the model's parameters are on {sorted(map(str, where))}, not on {want}; "
                "build or move the model there, or leave example_inputs out")  # fmt: skip
    return None


def _validate_everywhere(
    module: nn.Module,
    strategy: str,
    group_size: int,
    dtype: torch.dtype,
    model_probe: bool = False,
    probe_problem: str | None = None,
) -> _C.Strategy | None:
    """Checks the configuration on every rank and compares it across ranks before any other collective.

    Every rank takes part in one exchange even when its own input is bad, so a bad rank never leaves the
    others waiting: all ranks raise.
    """
    world = dist.get_world_size()
    error: Exception | None = None
    parsed = None
    try:
        if probe_problem is not None:
            raise ValueError(probe_problem)
        if strategy.strip().lower() != "auto":
            parsed = _C.Strategy(strategy)
        _C.check_topology(world, group_size)
        check_node_layout(group_size)
        for name, p in module.named_parameters():
            if not p.is_floating_point():
                raise ValueError(f"parameter {name} has dtype {p.dtype}; paro_torch shards floating-point "
                                 "parameters only: register it as a buffer instead")  # fmt: skip
    except (ValueError, TypeError) as e:
        error = e
    desc = [
        f"strategy={parsed.code if parsed else strategy.strip().lower()}",
        f"group_size={group_size}",
        f"dtype={dtype}",
        f"example_inputs={'given' if model_probe else 'none'}",
    ]
    desc += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in module.named_parameters()]
    digest = hashlib.sha256("\n".join(desc).encode()).digest()
    everyone = raise_together(error, "the ParoShardedModule configuration", torch.tensor([*digest[:16]]), ValueError)
    differ = [r for r in range(world) if not torch.equal(everyone[r], everyone[0])]
    if differ:
        raise ValueError(
            f"ranks disagree on the configuration: ranks {differ} differ from rank 0 in strategy, group size, "
            f"dtype, example_inputs or model structure (this rank: {', '.join(desc[:4])}); build the same model "
            "with the same arguments on every rank"
        )
    return parsed


def _links(
    calibration: LinkCalibration | str | None, groups: ParoGroups, device: torch.device, throughputs: bool = True
) -> LinkCalibration:
    """Link figures: given, read from a file (argument or PARO_CALIBRATION), else measured now.

    A measurement includes the stand-in throughputs unless a model probe follows (``throughputs=False``).
    """
    if isinstance(calibration, LinkCalibration):
        return calibration
    path = calibration or os.environ.get("PARO_CALIBRATION")
    return LinkCalibration.load(path) if path else measure_links(groups, device=device, throughputs=throughputs)
