"""State dicts of a sharded model: whole tensors gathered from the shards, and loaded back into them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from paro_torch._engine import init
from paro_torch._engine.engine import Engine
from paro_torch._engine.flat_buffer import FlatBuffer


def rank0_module_state(engine: Engine) -> dict[str, Any]:
    """The wrapped module's own state (buffers, extra state), rank 0's copies; collective."""
    own = {k: v.detach().clone() if torch.is_tensor(v) else v
           for k, v in engine.module.state_dict().items() if k not in engine.param_names}  # fmt: skip
    init.broadcast_from_rank0([v for v in own.values() if torch.is_tensor(v) and v.numel() > 0], engine.groups.whole)
    return own


def full_state_dict(engine: Engine, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter whole (masters for trainable ones) and every buffer; collective."""
    out: dict[str, torch.Tensor] = {}
    keep = not rank0_only or engine.groups.rank == 0
    own = rank0_module_state(engine)
    if keep:
        out.update(own)
    for b in engine.flat_buffers:
        values = b.full_values()
        if not keep:
            continue
        for s in b.slots:
            out[s.fqn] = values[s.offset : s.offset + s.numel].view(s.shape).clone()
            for _, _, alias in s.aliases:
                out[alias] = out[s.fqn]
    return out


def load_full_state_dict(
    engine: Engine, state_dict: dict[str, torch.Tensor], strict: bool = True
) -> tuple[list[str], list[str]]:
    """Loads whole parameters and buffers into the shards; returns the missing and the unexpected names."""
    where = {n: (b, i) for b in engine.flat_buffers for i, s in enumerate(b.slots) for n in s.names}
    shapes = {n: b.slots[i].shape for n, (b, i) in where.items()}
    own = {k for k in engine.module.state_dict() if k not in where}
    primary = {s.fqn for b in engine.flat_buffers for s in b.slots}
    missing = sorted((primary | own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(where) - own)
    differ = sorted(k for k in set(where) & set(state_dict) if tuple(state_dict[k].shape) != tuple(shapes[k]))
    if differ or (strict and (missing or unexpected)):
        raise ValueError(
            f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"other shapes {differ[:5]}; pass the full_state_dict() of the same model"
        )
    todo: dict[FlatBuffer, dict[int, torch.Tensor]] = {b: {} for b in engine.flat_buffers}
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
        engine.module.load_state_dict(rest, strict=False)
    return missing, unexpected


@contextlib.contextmanager
def summon_full_params(engine: Engine, rank0_only: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """The wrapped module with whole (read-only copies of) parameters for the duration; yields them; collective."""
    full = full_state_dict(engine, rank0_only=rank0_only)
    places = [
        (m, name, s.fqn)
        for b in engine.flat_buffers
        for s in b.slots
        for m, name in [(s.module, s.name), *[(a[0], a[1]) for a in s.aliases]]
    ] if full else []  # fmt: skip
    views = [m.__dict__.pop(name, None) for m, name, _ in places]  # the engine's views (see Unit.set_views)
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
