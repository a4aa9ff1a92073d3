"""The ``paro`` torch.distributed backend: registration, the creator that builds sub-backends, counters.

Every collective of a ``paro`` process group runs as a plan of the Rust planner (PaRO-CC): intra-group
steps on a sub-group of the fast-linked ranks, inter-group steps on a sub-group of the ranks with the same
local rank (one rail), chunked so that both levels work at once. The sub-groups are Gloo groups for CPU
tensors and, made on the first collective with CUDA tensors, NCCL groups (``PARO_DEVICE_SUB_BACKEND=gloo``:
Gloo groups) for CUDA tensors.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paro_torch import _C

logger = logging.getLogger("paro_torch")

BACKEND_NAME = "paro"
_DEFAULT_CHUNK_BYTES = 1 << 20
_DEFAULT_MAX_CHUNKS = 8
_LINKS_MAX_CHUNKS = 32
_warned_flat: set[tuple[int, ...]] = set()


@dataclass(frozen=True)
class ParoBackendOptions:
    """Options for ``init_process_group("paro", pg_options=...)`` and ``new_group(..., pg_options=...)``."""

    group_size: int | None = None
    """Ranks per group (fast-linked ranks, e.g. one node); used when PARO_GROUP_SIZE and LOCAL_WORLD_SIZE are unset."""
    chunk_bytes: int | None = None
    """Target chunk size for pipelining the two levels (PARO_CHUNK_BYTES; default: from ``links``, else 1 MiB)."""
    max_chunks: int | None = None
    """Most chunks per collective (PARO_MAX_CHUNKS; default 8, 32 with ``links``; 1 runs the levels one after the
    other)."""
    links: Any = None
    """Both levels' link figures (a ``paro_torch.LinkCalibration`` or the path of one saved by ``calibrate()``; also
    PARO_CALIBRATION): each collective's chunk count then comes from them, unless a chunk size is set."""


@dataclass(frozen=True)
class CommStats:
    """Bytes this rank sent and operations it issued, per level, since the last reset.

    ``flat_bytes`` and ``flat_ops`` count the global level (all ranks: all_to_all, point-to-point, ...).
    """

    intra_bytes: int
    inter_bytes: int
    flat_bytes: int
    intra_ops: int
    inter_ops: int
    flat_ops: int


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def resolve_group_size(world_size: int, options: ParoBackendOptions | None = None) -> int:
    """Ranks per group: PARO_GROUP_SIZE, else torchrun's LOCAL_WORLD_SIZE, else the option, else the world."""
    for source, value in (
        ("PARO_GROUP_SIZE", _env_int("PARO_GROUP_SIZE")),
        ("LOCAL_WORLD_SIZE", _env_int("LOCAL_WORLD_SIZE")),
        ("ParoBackendOptions.group_size", options.group_size if options else None),
    ):
        if value is not None:
            if value < 1:
                raise _C.TopologyError(f"{source}={value}: the group size must be at least 1")
            check_node_layout(value, source)
            return value
    return world_size


def check_node_layout(group_size: int, source: str = "group_size") -> None:
    """Under torchrun, a group must lie inside one node or cover whole nodes (LOCAL_WORLD_SIZE ranks each).

    Otherwise some "intra-group" traffic crosses the slow inter-node links and some groups share a node.
    """
    local = _env_int("LOCAL_WORLD_SIZE")
    if local is not None and local % group_size != 0 and group_size % local != 0:
        raise _C.TopologyError(
            f"{source}={group_size} does not match torchrun's layout of {local} ranks per node "
            f"(LOCAL_WORLD_SIZE): groups would straddle nodes; use a divisor of {local} (groups inside a node) "
            f"or a multiple of it (groups of whole nodes)"
        )


def _options(backend_options: Any) -> ParoBackendOptions | None:
    if backend_options is None or isinstance(backend_options, ParoBackendOptions):
        return backend_options
    if isinstance(backend_options, dict):
        return ParoBackendOptions(**backend_options)
    return None


SubBackend = Callable[[str, int, int], Any]
"""Makes one sub-backend: (store prefix, rank, size) -> a torch.distributed Backend object."""


def _gloo(store: dist.Store, timeout: timedelta, prefix: str, rank: int, size: int) -> dist.ProcessGroupGloo:
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)


def _nccl(store: dist.Store, timeout: timedelta, device: torch.device, prefix: str, rank: int, size: int) -> Any:
    """An NCCL sub-backend, as torch makes "nccl" groups: ProcessGroupNCCL2 unless TORCH_DIST_USE_NCCL2=0."""
    if not dist.is_nccl_available():
        raise RuntimeError(
            "this torch build has no NCCL, which a paro group needs for CUDA tensors; set "
            "PARO_DEVICE_SUB_BACKEND=gloo to run them on Gloo, or use init_process_group('cpu:paro,cuda:nccl')"
        )
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.group_name = prefix
    nccl2 = getattr(dist.distributed_c10d, "ProcessGroupNCCL2", None)
    if nccl2 is not None and os.environ.get("TORCH_DIST_USE_NCCL2") != "0":
        return nccl2(dist.PrefixStore(prefix, store), rank, size, opts, device)
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)


def _levels(make: SubBackend, base: str, rank: int, size: int, m: int) -> tuple[Any, Any, Any]:
    """(intra, inter, global) sub-backends of a group of `size` ranks in groups of `m` (0: the global one only)."""
    global_ = make(base + "flat/", rank, size)
    if m == 0:
        return None, None, global_
    g = size // m
    k, r = divmod(rank, m)
    intra = global_ if g == 1 else (None if m == 1 else make(f"{base}intra/{k}/", r, m))
    inter = global_ if m == 1 else (None if g == 1 else make(f"{base}inter/{r}/", k, g))
    return intra, inter, global_


# Per backend instance (the key given to the C++ backend): what makes its device sub-backends, until it is used.
_device_makers: dict[int, Callable[[torch.device], tuple[Any, Any, Any]]] = {}
_device_keys = itertools.count()


def _device_levels(
    store: dist.Store, timeout: timedelta, base: str, rank: int, size: int, m: int, device: torch.device
) -> tuple[Any, Any, Any]:
    kind = os.environ.get("PARO_DEVICE_SUB_BACKEND", "nccl")
    if kind == "nccl":
        make: SubBackend = functools.partial(_nccl, store, timeout, device)
    elif kind == "gloo":
        make = functools.partial(_gloo, store, timeout)
    else:
        raise ValueError(f"PARO_DEVICE_SUB_BACKEND={kind!r}: use 'nccl' (the default) or 'gloo'")
    return _levels(make, f"{base}{device.type}/", rank, size, m)


def _device_sub_backends(key: int, device: str) -> tuple[Any, Any, Any]:
    """Called by the C++ backend on its first collective with tensors on `device`: (intra, inter, global)."""
    make = _device_makers.pop(key, None)
    if make is None:
        raise RuntimeError(f"paro: no sub-backends can be made for {device} (process group instance {key})")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"paro: tensors on {dev} are not supported; use CPU or CUDA tensors")
    return make(dev)


_C.set_device_factory(_device_sub_backends)


def _create(dist_backend_opts: Any, backend_options: Any) -> Any:
    """Creator for ``Backend.register_backend(..., extended_api=True)``; runs on every rank of the new group."""
    opts = _options(backend_options)
    store, rank, size, timeout = (
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,
    )
    subgroup = bool(dist_backend_opts.global_ranks_in_group)
    global_ranks = list(dist_backend_opts.global_ranks_in_group) or list(range(size))
    if subgroup:
        group_size = resolve_group_size(dist.get_world_size(), opts)
    else:  # the world group: the group size must divide it, checked on every rank before any communication
        group_size = resolve_group_size(size, opts)
        _C.check_topology(size, group_size)
    shape, reason = _C.subgroup_shape(global_ranks, group_size)
    chunk_bytes = _env_int("PARO_CHUNK_BYTES") or (opts and opts.chunk_bytes) or 0
    links = _links(opts.links if opts else None) if not chunk_bytes else None
    max_chunks = _env_int("PARO_MAX_CHUNKS") or (opts and opts.max_chunks)
    if links is None:
        chunk_bytes = chunk_bytes or _DEFAULT_CHUNK_BYTES
    max_chunks = max_chunks or (_DEFAULT_MAX_CHUNKS if links is None else _LINKS_MAX_CHUNKS)

    # Every instance gets fresh store keys, so a group created again after destroy_process_group (same
    # group name, same store under torchrun) never meets the previous instance's Gloo rendezvous keys.
    instance = (store.add("paro/instances", 1) - 1) // size
    base = f"paro/{instance}/"
    if shape is None:
        key = tuple(global_ranks)
        if key not in _warned_flat:
            _warned_flat.add(key)
            logger.warning("paro: process group %s runs flat collectives: %s", global_ranks, reason)
        m = 0
    else:
        _, m = shape
    intra, inter, global_ = _levels(functools.partial(_gloo, store, timeout), base + "cpu/", rank, size, m)
    device_key = -1
    if torch.cuda.is_available():  # CUDA sub-backends, made on the first collective with CUDA tensors
        device_key = next(_device_keys)
        _device_makers[device_key] = functools.partial(_device_levels, store, timeout, base, rank, size, m)
    return _C.create_backend(
        size, m, rank, chunk_bytes, max_chunks, intra, inter, global_, device_key, links or [0.0] * 4
    )


def _links(given: Any) -> list[float] | None:
    """[intra bandwidth, latency, inter bandwidth, latency] from a LinkCalibration, its file or PARO_CALIBRATION."""
    given = given if given is not None else os.environ.get("PARO_CALIBRATION") or None
    if given is None:
        return None
    from paro_torch.auto import LinkCalibration

    cal = given if isinstance(given, LinkCalibration) else LinkCalibration.load(given)
    return [cal.intra.bandwidth, cal.intra.latency, cal.inter.bandwidth, cal.inter.latency]


def register() -> None:
    """Registers ``paro`` with torch.distributed (idempotent; also the package's entry point)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    try:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    except Exception as e:
        raise RuntimeError(f"paro_torch: failed to register the {BACKEND_NAME!r} process group backend: {e}") from e


def _paro_backend(group: dist.ProcessGroup | None) -> Any:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every backend in a checker that runs its collectives
    wrapper = getattr(torch._C._distributed_c10d, "_ProcessGroupWrapper", None)
    return backend.wrapped_pg if wrapper is not None and isinstance(backend, wrapper) else backend


def comm_stats(group: dist.ProcessGroup | None = None) -> CommStats:
    """Bytes sent and operations issued per level by this rank on a ``paro`` group since ``reset_comm_stats``."""
    (ib, io), (eb, eo), (fb, fo) = _C.backend_stats(_paro_backend(group))
    return CommStats(intra_bytes=ib, inter_bytes=eb, flat_bytes=fb, intra_ops=io, inter_ops=eo, flat_ops=fo)


def reset_comm_stats(group: dist.ProcessGroup | None = None) -> None:
    """Zeroes the counters of a ``paro`` group."""
    _C.reset_backend_stats(_paro_backend(group))
