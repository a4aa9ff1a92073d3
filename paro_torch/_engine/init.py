"""Initialisation: the configuration checked on every rank, meta-device models materialised, the units built."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from paro_torch import _C
from paro_torch._agree import raise_together
from paro_torch._backend import check_node_layout, resolve_group_size
from paro_torch._engine.flat_buffer import FlatBuffer
from paro_torch._engine.layout import BufferLayout, G, I, N, ParamSlot
from paro_torch._engine.storage import storage_dtype
from paro_torch._engine.units import Assignment, Unit
from paro_torch._groups import ParoGroups
from paro_torch.api import Precision


def requested_group_size(
    group_size: int | None,
    process_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] | None,
    device_mesh: DeviceMesh | None,
) -> int:
    """Ranks per group from whichever of the three the user gave (else PARO_GROUP_SIZE, LOCAL_WORLD_SIZE, all)."""
    if device_mesh is not None:
        return device_mesh.size(device_mesh.ndim - 1)
    if process_groups is not None:
        return dist.get_world_size(process_groups[0]) if process_groups[0] is not None else 1
    return group_size if group_size is not None else resolve_group_size(dist.get_world_size())


def probe_problem(module: nn.Module, example_inputs: Any, tokens: int | None, device: Any) -> str | None:
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


def validate_everywhere(
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
            if isinstance(p, DTensor):
                raise ValueError(
                    f"parameter {name} is a DTensor already: the model was wrapped before (a ParoShardedModule: use "
                    "it, ParoShardedModule.of(model)) or sharded by FSDP2 or tensor parallelism; wrap a model of "
                    "plain tensors"
                )
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


def broadcast_from_rank0(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Makes the tensors equal to rank 0's (one broadcast per dtype)."""
    tensors = list({id(t): t for t in tensors}.values())
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=0, group=group)
        with torch.no_grad():
            for t, v in zip(same, flat.split([t.numel() for t in same]), strict=True):
                t.copy_(v.view_as(t))


def scatter_from_rank0(
    layout: BufferLayout, values: list[torch.Tensor], p: str, dtype: torch.dtype, received: dict[str, int]
) -> tuple[int, torch.Tensor]:
    """This rank's range of rank 0's values of one buffer, blocked: (offset, values), in ``dtype``.

    [Note: start-up scatter] Each rank receives only what it keeps: rank 0 scatters the I-chunks (blocked at the
    buffer's level) inside its group, and each of its group's ranks passes its chunk along its rail to the other
    groups, whole (p = I, N) or as the G-blocks each rank keeps (p = G); at p = N each group then all-gathers its
    chunks. A rank outside group 0 receives Psi / m over the slow link for p = I and N and Psi / n for p = G,
    where a broadcast from rank 0 sends every rank the whole model. ``received`` adds up the bytes this rank
    received, per level.
    """
    g = layout.groups
    size = layout.padded // g.group_size  # an I-chunk
    chunk = torch.empty(size, dtype=dtype, device=layout.device)
    if g.group_index == 0:
        if g.rank == 0:
            parts = [v.detach().reshape(-1) for v in values]
            whole = layout._pack(parts, 0, layout.padded, dtype)
            chunks = list(whole.split(size))
        if g.intra is not None:
            dist.scatter(chunk, chunks if g.rank == 0 else None, src=0, group=g.intra)
            received["intra"] += 0 if g.rank == 0 else chunk.numel() * chunk.element_size()
        else:
            chunk = chunks[0]
    if p == G:
        keep = torch.empty(size // g.num_groups, dtype=dtype, device=layout.device)
        if g.inter is not None:
            src = dist.get_global_rank(g.inter, 0)
            dist.scatter(keep, list(chunk.split(keep.numel())) if g.group_index == 0 else None, src=src, group=g.inter)
            received["inter"] += 0 if g.group_index == 0 else keep.numel() * keep.element_size()
        else:
            keep = chunk
        return layout.range(G)[0], keep
    if g.inter is not None:
        dist.broadcast(chunk, src=dist.get_global_rank(g.inter, 0), group=g.inter)
        received["inter"] += 0 if g.group_index == 0 else chunk.numel() * chunk.element_size()
    if p == I:
        return layout.range(I)[0], chunk
    whole = torch.empty(layout.padded, dtype=dtype, device=layout.device)  # p = N
    if g.intra is not None:
        dist.all_gather_into_tensor(whole, chunk, group=g.intra)
        received["intra"] += (whole.numel() - chunk.numel()) * whole.element_size()
    else:
        whole.copy_(chunk)
    return 0, whole


def materialize(
    members: list[nn.Module],
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None,
    names: dict[int, str] | None = None,
) -> None:
    """Gives a unit's modules real (uninitialised) tensors for their meta ones, then initialises each module.

    ``init_fn(module)`` (default: its ``reset_parameters()``, where it has one) runs once per module, in order.
    Tied parameters stay tied. Without ``init_fn``, a module with meta tensors and no ``reset_parameters()`` (a
    custom norm's weight, a rotary table) raises ValueError naming them (``names``: module → qualified name) before
    anything is allocated: they would keep uninitialised memory.
    """
    if init_fn is None:
        bare = [
            f"{(names or {}).get(id(m), type(m).__name__)}.{n}".lstrip(".")
            for m in members
            if not callable(getattr(m, "reset_parameters", None))
            for n, t in [*m._parameters.items(), *m._buffers.items()]
            if t is not None and t.is_meta
        ]
        if bare:
            raise ValueError(
                f"the model is on the meta device and nothing initialises {bare[:6]}{' ...' if len(bare) > 6 else ''}"
                " (their modules have no reset_parameters()); pass param_init_fn= (called once per module, its "
                "tensors materialised on the device) or give those modules a reset_parameters()"
            )
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


def build_units(
    assignments: list[Assignment],
    strategy: _C.Strategy,
    groups: ParoGroups,
    mesh: DeviceMesh,
    precision: Precision,
    reduce_groups: ParoGroups,
    device: torch.device,
    sync: bool,
    init_fn: Callable[[nn.Module], None] | None,
    received: dict[str, int],
) -> list[Unit]:
    """Shards unit by unit, so that no rank holds more than the shards and one whole unit.

    A unit on the meta device is materialised and initialised first; with ``sync`` it becomes rank 0's, and
    ``received`` adds up the bytes of rank 0's values this rank received, per level ("intra", "inter", "whole").
    """
    units = []
    names = {id(m): n for n, m in assignments[-1][0].named_modules()} if assignments else {}  # the root's
    for block, entries, members in assignments:
        if any(e[3].is_meta for e in entries) or any(b.is_meta for m in members for b in m.buffers(False)):
            materialize(members, device, init_fn, names)
            entries = [(fqn, m, name, m._parameters[name]) for fqn, m, name, _ in entries]
        for m in members:  # buffers live on the parameters' device
            for name, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[name] = b.to(device)
        if sync:  # parameters scattered below, where they are laid out in blocks
            own = [b for m in members for b in m.buffers(False)]
            blocked = strategy.os != N  # a trainable buffer's level is os, a frozen one's p
            whole = [e[3] for e in entries if not (blocked if e[3].requires_grad else strategy.p != N)]
            broadcast_from_rank0(whole + own, groups.whole)
            if whole:
                received["whole"] += sum(t.numel() * t.element_size() for t in whole) if groups.rank else 0
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
            level = strategy.os if trainable else strategy.p
            got = None
            if sync and level != N:  # see [Note: start-up scatter]
                dtype = precision.master if trainable else storage_dtype(precision, False, values)
                layout = BufferLayout(slots, groups, mesh, level, device)
                got = scatter_from_rank0(layout, values, strategy.p, dtype, received)
            buffer = FlatBuffer(slots, values, strategy, groups, mesh, trainable, precision,
                                reduce_groups=reduce_groups, device=device, received=got)  # fmt: skip
            for slot, param in zip(slots, buffer.params, strict=True):
                for m, name in slot.targets:
                    m._parameters[name] = param  # the shard, under the parameter's own name
            buffers.append(buffer)
        units.append(Unit(len(units), block, buffers))
    return units
