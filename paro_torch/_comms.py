"""The engine's communicators and lanes: one set per process groups and device, shared by every module on them.

[Note: shared lanes] Every ``ParoShardedModule`` built on the same process groups (and device) issues its gathers
on one lane and its reductions on another (see [Note: lanes] in _lanes.py), each lane with communicators of its
own, twins of the user's groups (the parameter mesh has its own, for DTensor ops on the caller's thread). Sharing
the lanes keeps one order per communicator when several modules run at once (a model and its teacher, a generator
and a discriminator): their calls go out in the order the program issues them, which is the same on every rank,
as with FSDP2 modules sharing one process group. And the communicators are made once per job, not per module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from paro_torch._groups import ParoGroups, new_group, own_mesh, shared, twin_groups
from paro_torch._lanes import Lane, make_lane


@dataclass(frozen=True)
class EngineComms:
    """What the modules on ``groups`` and ``device`` share."""

    groups: ParoGroups
    mesh: DeviceMesh
    """The (intra, inter) mesh of the sharded parameters (DTensors); its groups serve DTensor ops only."""
    gather_groups: ParoGroups
    """Twins of ``groups`` for the gather lane: the user's own groups carry none of the engine's collectives, so
    a collective the user issues on them (in a hook, a metric) never races the lane's."""
    reduce_groups: ParoGroups
    """Twins of ``groups`` for the reduction lane."""
    gather_world: dist.ProcessGroup
    """All ranks, for the gather lane's small collectives (buffer broadcasts, which units backward needs)."""
    gathers: Lane
    reducer: Lane

    def release(self) -> None:
        """Drops the communicators made for this set: only at exit (see [Note: communicators at exit] in _groups.py)."""
        self.groups.release()
        self.gather_groups.release()
        self.reduce_groups.release()
        object.__setattr__(self, "gather_world", None)  # frozen for everyone else


def engine_comms(groups: ParoGroups, device: torch.device) -> EngineComms:
    """The set for ``groups`` and ``device``, made on first use; every rank must call it in the same order."""
    key = ("engine", id(groups.intra), id(groups.inter), id(groups.whole), device)  # the set holds the groups
    return shared(key, lambda: _make(groups, device))


def _make(groups: ParoGroups, device: torch.device) -> EngineComms:
    whole_backend = dist.get_backend(groups.whole)
    return EngineComms(
        groups=groups,
        mesh=_mesh(groups, device.type),
        gather_groups=twin_groups(groups),
        reduce_groups=twin_groups(groups),
        gather_world=new_group(list(range(groups.world)), whole_backend),
        gathers=make_lane(device, "paro-gather"),
        reducer=make_lane(device, "paro-reduce", in_flight=1),  # see [Note: memory across streams] in _lanes.py
    )


def _mesh(groups: ParoGroups, device_type: str) -> DeviceMesh:
    """The 2-D mesh (intra, inter): ``mesh[r][k]`` is rank k·m + r, so placements shard by local rank first.

    [Note: no flattened mesh] G is ``(Shard(0), Shard(0))`` on it: the I-chunk by local rank, then the G-chunk
    by group, as the engine's blocks nest (``layout.py``). The mesh is never flattened: given a flattened mesh of
    equal ranks, torch 2.15's redistribution merges the two levels into one collective over it, which gathers in
    sorted rank order and in equal chunks, not in the nested order with the nested (uneven) chunks, and so
    scrambles ``full_tensor()`` and the full state dict. Per dimension (an all-gather, or a global norm's
    all-reduce, on each level in turn) it is right for every shape.
    """
    m, g = groups.group_size, groups.num_groups
    ranks = torch.tensor([[k * m + r for k in range(g)] for r in range(m)], dtype=torch.int64)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("intra", "inter"))
    own_mesh(mesh)
    _quiet_flatten_advice()
    return mesh


def _quiet_flatten_advice() -> None:
    """Drops torch's advice to flatten the mesh (see [Note: no flattened mesh]): following it would scramble."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _NoFlattenAdvice) for f in log.filters):
        log.addFilter(_NoFlattenAdvice())


class _NoFlattenAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "flatten mesh dimensions" not in record.getMessage()
