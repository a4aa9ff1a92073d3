"""The two communicators of PaRO-DP: the intra-group one (fast links) and the inter-group one (a rail)."""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from paro_torch import _C
from paro_torch._backend import resolve_group_size

T = TypeVar("T")


@dataclass(frozen=True)
class ParoGroups:
    """This rank's place in g groups of m ranks, and the process groups of both levels.

    Vocabulary: *intra* = the m ranks of this rank's group (granularity I); *inter* = the g ranks with this
    rank's local rank, one per group (a rail); *world* = all n ranks (granularity G).
    """

    world: int
    group_size: int
    rank: int
    intra: dist.ProcessGroup | None
    """The m ranks of this group (None when m == 1)."""
    inter: dist.ProcessGroup | None
    """The g ranks sharing this local rank (None when g == 1)."""
    whole: dist.ProcessGroup
    """All ranks, for checks."""

    def release(self) -> None:
        """Drops this set's communicators: only at exit (see [Note: communicators at exit])."""
        for name in ("intra", "inter", "whole"):
            object.__setattr__(self, name, None)  # frozen for everyone else

    @property
    def num_groups(self) -> int:
        """G."""
        return self.world // self.group_size

    @property
    def group_index(self) -> int:
        """k, this rank's group."""
        return self.rank // self.group_size

    @property
    def local_rank(self) -> int:
        """r, this rank's index inside its group."""
        return self.rank % self.group_size


def build_groups(
    group_size: int | None = None,
    process_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] | None = None,
    device_mesh: DeviceMesh | None = None,
    backend: str | None = None,
) -> ParoGroups:
    """Creates (or adopts) the intra- and inter-group process groups; every rank must call it.

    Args:
        group_size: Ranks per group; default PARO_GROUP_SIZE, else torchrun's LOCAL_WORLD_SIZE, else all ranks.
        process_groups: An ``(intra, inter)`` pair to use as they are (as FSDP1's hybrid tuple).
        device_mesh: A 2-D mesh, outer dimension = inter-group (replicate), inner = intra-group (shard), as
            FSDP2 and accelerate lay out HSDP.
        backend: The backend of new groups: default the world's (Gloo on CPU). The engine runs the hierarchy
            itself, so plain groups suffice; ``"paro"`` groups count the bytes each level sends.

    Raises:
        TopologyError: the group size does not divide the world size, or the groups given do not fit.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if device_mesh is not None:
        if device_mesh.ndim != 2:
            raise _C.TopologyError(f"device_mesh must be 2-D (inter, intra); got {device_mesh.ndim} dimensions")
        process_groups = (device_mesh.get_group(1), device_mesh.get_group(0))
    if process_groups is not None:
        intra, inter = process_groups
        m = dist.get_world_size(intra) if intra is not None else 1
        g = dist.get_world_size(inter) if inter is not None else 1
        local = dist.get_rank(intra) if intra is not None else 0
        index = dist.get_rank(inter) if inter is not None else 0
        if m * g != world or local != rank % m or index != rank // m:
            raise _C.TopologyError(
                f"process_groups do not form {world} ranks as groups of consecutive ranks: intra has {m} ranks, "
                f"inter {g}; pass (intra, inter) with intra = ranks k*m..k*m+m-1 and inter = ranks r, r+m, ..."
            )
        return ParoGroups(world, m, rank, intra if m > 1 else None, inter if g > 1 else None, dist.group.WORLD)
    m = group_size if group_size is not None else resolve_group_size(world)
    _C.check_topology(world, m)
    return shared(("groups", m, backend), lambda: _new_groups(world, m, rank, backend))


_shared: dict[tuple[Any, ...], Any] = {}
_shared_world: list[dist.ProcessGroup | None] = [None]
_made: list[dist.ProcessGroup] = []
"""The communicators paro_torch made for the current default group (see [Note: communicators at exit])."""
_meshes: list[dict[str, dist.ProcessGroup]] = []
"""The registries of paro_torch's meshes, which hold their communicators."""


def shared(key: tuple[Any, ...], make: Callable[[], T]) -> T:
    """``make()``'s value for ``key``, made once per default process group; every rank must ask in the same order.

    Process groups live until the default group is destroyed, and each costs a connection to every peer (and, for
    Gloo, threads) and a rendezvous to make: the engine makes its communicators once per job and layout, not once
    per wrapped module. A new default group (after ``destroy_process_group``) starts afresh.
    """
    world = dist.group.WORLD
    if _shared_world[0] is not world:
        _shared.clear()
        _made.clear()  # the old default group's: destroyed with it, and now by this
        _meshes.clear()
        _shared_world[0] = world
    if key not in _shared:
        _shared[key] = make()
    return _shared[key]


def new_group(ranks: list[int], backend: str | None) -> dist.ProcessGroup | None:
    """``dist.new_group`` for a communicator of paro_torch's own; every rank must call it.

    None on the ranks outside ``ranks``; destroyed at exit (see [Note: communicators at exit]).
    """
    pg = dist.new_group(ranks, backend=backend)
    if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    _made.append(pg)
    return pg


def own_mesh(*meshes: DeviceMesh) -> None:
    """Adds the communicators of meshes that paro_torch made to those it destroys at exit.

    Every dimension's, flattened ones included; the meshes drop them then (see [Note: communicators at exit]).
    """
    for mesh in meshes:
        registry: dict[str, dist.ProcessGroup] | None = getattr(mesh, "_pg_registry", None)  # recent torch
        pgs = list(registry.values()) if registry is not None else []
        pgs += [mesh.get_group(dim) for dim in range(mesh.ndim)]
        for pg in pgs:  # a group can be in the registry and a dimension's, or in both meshes
            if pg != dist.group.WORLD and all(pg is not q for q in _made):
                _made.append(pg)
        if registry is not None:
            _meshes.append(registry)


# [Note: communicators at exit] Gloo runs each collective on a thread of its own, which drops its references to
# the collective (and its tensors) only after it has woken the caller. When Python dropped the tensors first, that
# last drop frees their Python objects and takes the GIL; a thread that takes the GIL once the interpreter finalizes
# exits on the spot, inside a destructor, and the process aborts ("terminate called without an active exception")
# after a job that did everything right. A process group joins its threads when it is destroyed, so at exit, while
# the interpreter is still alive, paro_torch destroys the Gloo communicators it made and drops every reference it
# holds to them (the engine's modules hold them only through the sets released here): their threads finish and join
# whether or not the script destroyed the default group, and with wrapped models still alive. The groups a user
# made (the default one included) are the user's to destroy. tests/workers/exit_in_flight.py holds this.
def _release_at_exit() -> None:
    if os.getpid() != _PID:
        return  # a forked child: the groups' threads are the parent's
    holders = list(_shared.values())
    _shared.clear()
    _shared_world[0] = None
    for holder in holders:
        release = getattr(holder, "release", None)
        if callable(release):
            release()
    for registry in _meshes:
        registry.clear()
    _meshes.clear()
    made = list(_made)
    _made.clear()
    for pg in made:
        if dist.is_initialized() and pg != dist.group.WORLD and dist.get_backend(pg) == "gloo":
            try:
                dist.destroy_process_group(pg)  # unregisters it: torch held it too
            except ValueError:  # already destroyed
                pass
    del holders, made  # the last references: each group joins its threads here


def twin_groups(groups: ParoGroups) -> ParoGroups:
    """New communicators over the same ranks and backend as ``groups``; every rank must call it.

    Collectives on two threads need their own communicators: each thread's sequence is the same on every rank,
    but how the two interleave is not.
    """
    level = groups.intra or groups.inter
    backend = dist.get_backend(level) if level is not None else None
    twin = _new_groups(groups.world, groups.group_size, groups.rank, backend)
    whole = new_group(list(range(groups.world)), backend=backend)
    assert whole is not None
    return ParoGroups(twin.world, twin.group_size, twin.rank, twin.intra, twin.inter, whole)


def _new_groups(world: int, m: int, rank: int, backend: str | None) -> ParoGroups:
    g = world // m
    intra = inter = None
    for k in range(g):  # every rank creates every group, in the same order
        pg = new_group(list(range(k * m, (k + 1) * m)), backend) if m > 1 else None
        if k == rank // m:
            intra = pg
    for r in range(m):
        pg = new_group(list(range(r, world, m)), backend) if g > 1 else None
        if r == rank % m:
            inter = pg
    return ParoGroups(world, m, rank, intra, inter, dist.group.WORLD)


_PID = os.getpid()
atexit.register(_release_at_exit)  # at import: runs after the exit handlers registered later (LIFO)
