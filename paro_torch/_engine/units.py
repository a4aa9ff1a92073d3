"""Communication units: which parameters each wrapped block owns, and where a unit is in the step."""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
import torch.nn as nn

from paro_torch._engine.flat_buffer import FlatBuffer

WrapPolicy = set[type[nn.Module]] | Callable[[nn.Module], bool] | None

Entry = tuple[str, nn.Module, str, nn.Parameter]
"""(fqn, owning module, attribute name, parameter)."""

Assignment = tuple[nn.Module, list[Entry], list[nn.Module]]
"""A unit's module, its parameters and its own modules (those of its subtree outside inner units)."""


def assign_units(module: nn.Module, policy: WrapPolicy) -> list[Assignment]:
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
    by_unit: dict[int, list[Entry]] = {id(b): [] for b in blocks}
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
    """Its gradients are complete and handed to the reduction lane."""


class Unit:
    """The parameters of one wrapped block: a trainable and a frozen flat buffer."""

    def __init__(self, index: int, module: nn.Module, buffers: list[FlatBuffer]) -> None:
        self.index = index
        """Position in the engine's units (reverse definition order, root last): its bit in per-unit flags."""
        self.module = module
        self.buffers = buffers
        self.state = TrainingState.IDLE
        self.needs_sync = False
        """The masters may have changed: t_syncp before the next compute."""

    def gather(self) -> None:
        """Brings the parameters up to date after an optimizer step (t_syncp), then unshards them."""
        for b in self.buffers:
            if self.needs_sync and b.trainable:
                b.sync_params()
            b.unshard()
        self.needs_sync = False

    def begin_call(self, call: int) -> None:
        """Its views for a forward with grad come from that call's leaves (see ``BufferStorage.begin_call``)."""
        for b in self.buffers:
            b.begin_call(call)

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
