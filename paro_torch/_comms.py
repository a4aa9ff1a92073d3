"""The engine's communicators and lanes: one set per process groups and device, shared by every module on them.

[Note: shared lanes] Every ``ParoShardedModule`` built on the same process groups (and device) issues its gathers
on one lane and its reductions on another (see [Note: lanes] in _lanes.py), each lane with communicators of its
own: the user's groups for the gathers (and the parameter mesh for DTensor ops on the caller's thread), twins of
them for the reductions. Sharing the lanes keeps one order per communicator when several modules run at once (a
model and its teacher, a generator and a discriminator): their calls go out in the order the program issues them,
which is the same on every rank, as with FSDP2 modules sharing one process group. And the communicators are made
once per job, not per module.
"""

from __future__ import annotations

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
    reduce_groups: ParoGroups
    """Twins of ``groups`` for the reduction lane."""
    gather_world: dist.ProcessGroup
    """All ranks, for the gather lane's small collectives (buffer broadcasts, which units backward needs)."""
    gathers: Lane
    reducer: Lane

    def release(self) -> None:
        """Drops the communicators made for this set: only at exit (see [Note: communicators at exit] in _groups.py)."""
        self.groups.release()
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
        reduce_groups=twin_groups(groups),
        gather_world=new_group(list(range(groups.world)), whole_backend),
        gathers=make_lane(device, "paro-gather"),
        reducer=make_lane(device, "paro-reduce"),
    )


def _mesh(groups: ParoGroups, device_type: str) -> DeviceMesh:
    """The 2-D mesh (intra, inter): ``mesh[r][k]`` is rank k·m + r, so placements shard by local rank first."""
    m, g = groups.group_size, groups.num_groups
    ranks = torch.tensor([[k * m + r for k in range(g)] for r in range(m)], dtype=torch.int64)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("intra", "inter"))
    flat = mesh._flatten("paro_world")  # DTensor reduces over both dimensions at once with it (e.g. a global norm)
    own_mesh(mesh, flat)
    return mesh
