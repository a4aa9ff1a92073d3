"""Sharded checkpoints of a ParoShardedModule and its optimizer through torch.distributed.checkpoint (DCP).

Layout, independent of the strategy, the group size and the world size (so loading reshards):

- ``model.<name>``: each parameter as the DTensor ``state_dict()`` holds (trainable ones: the masters) and
  each buffer (rank 0's);
- ``optim.<name>.<state>``: optimizer states (DTensors shaped like the parameters, and scalars such as ``step``);
- ``optim.param_groups``: the hyperparameters of each param group.

DCP writes each rank's chunks once and reads, on load, the rows each rank's shards cover. A save goes to
``<path>.partial`` and rank 0 renames it to ``path`` after every rank has written its part and ``paro.json``
marks it complete, so an interrupted save never appears under ``path``.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from paro_torch._agree import raise_together
from paro_torch.sharded_module import ParoShardedModule

MARKER = "paro.json"
EXTRA = "extra.pt"
FORMAT = 2


def _params(model: ParoShardedModule) -> dict[str, nn.Parameter]:
    """Every parameter (this rank's shard) under its primary name."""
    return {s.fqn: p for b in model._flat_buffers for s, p in zip(b.slots, b.params, strict=True)}


def _trainable(model: ParoShardedModule) -> dict[str, nn.Parameter]:
    return {s.fqn: p for b in model._flat_buffers if b.trainable for s, p in zip(b.slots, b.params, strict=True)}


def _model_entries(model: ParoShardedModule, buffers: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {f"model.{k}": p.detach() for k, p in _params(model).items()}
    out.update({f"model.{k}": v for k, v in buffers.items()})
    return out


def _module_buffers(model: ParoShardedModule) -> dict[str, torch.Tensor]:
    """The wrapped module's persistent buffers (e.g. BatchNorm statistics): the tensors themselves, to load into."""
    names = model._engine.param_names
    return {k: v for k, v in model.module.state_dict(keep_vars=True).items() if torch.is_tensor(v) and k not in names}


def _optimizer_entries(model: ParoShardedModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    _check_optimizer(model, optimizer)
    out: dict[str, Any] = {}
    for fqn, p in _trainable(model).items():
        for name, v in optimizer.state.get(p, {}).items():
            out[f"optim.{fqn}.{name}"] = v
    # a tuple is one object for DCP (a list of dicts would be flattened into entries)
    out["optim.param_groups"] = tuple({k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups)
    return out


def _check_optimizer(model: ParoShardedModule, optimizer: torch.optim.Optimizer) -> None:
    mine = {id(p) for p in model.parameters()}
    if any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "the optimizer holds tensors that are not this ParoShardedModule's parameters; build it on "
            "model.parameters() (the sharded parameters), after wrapping the model"
        )


def save_checkpoint(
    path: str | os.PathLike[str],
    model: ParoShardedModule,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Saves the model's parameters (and the optimizer's state) as a sharded DCP checkpoint; call on every rank.

    Each rank writes only what it holds; the checkpoint loads into any strategy and world size
    (``load_checkpoint``). ``path`` is a directory on a file system every rank can reach. ``extra``: rank 0's
    other training state (a trainer's loops, schedulers), saved with ``torch.save`` inside the same atomic save
    (``read_extra``).
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    rank = dist.get_rank()
    error = None
    try:
        saved_buffers = {k: v for k, v in model.rank0_module_state().items() if torch.is_tensor(v)}
        entries = _model_entries(model, saved_buffers)
        if optimizer is not None:
            entries.update(_optimizer_entries(model, optimizer))
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
    except (ValueError, OSError) as e:
        error = e
    raise_together(error, "save_checkpoint")
    dcp.save(entries, storage_writer=dcp.FileSystemWriter(partial))
    dist.barrier()
    if rank == 0:
        marker = {
            "format": FORMAT,
            "strategy": model.strategy.code,
            "world_size": dist.get_world_size(),
            "group_size": model.groups.group_size,
            "optimizer": optimizer is not None,
            "params": {k: list(p.shape) for k, p in _params(model).items()},
            "buffers": sorted(saved_buffers),
        }
        if extra is not None:
            torch.save(extra, partial / EXTRA)
        # every file's size and checksum: a truncated or damaged file is refused on load, never read silently
        marker["files"] = {f.name: _digest(f) for f in sorted(partial.iterdir()) if f.is_file()}
        (partial / MARKER).write_text(json.dumps(marker, indent=1))
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_checkpoint(
    path: str | os.PathLike[str], model: ParoShardedModule, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Loads a checkpoint written by ``save_checkpoint`` into ``model`` (and ``optimizer``); call on every rank.

    The checkpoint may come from another strategy, group size or world size: each rank reads the slices its
    shards cover. Raises on every rank, before reading any tensor, if the checkpoint is incomplete or does
    not match the model.
    """
    path = Path(path)
    error = None
    entries: dict[str, Any] = {}
    states: dict[int, dict[str, torch.Tensor | str]] = {}
    try:
        marker = _read_marker(path)
        if dist.get_rank() == 0:  # one reader checks the files; raise_together tells every rank
            _check_files(path, marker)
        metadata = dcp.FileSystemReader(path).read_metadata()
        _check_compatible(model, marker, metadata, path)
        live = _module_buffers(model)
        entries = {k: v for k, v in _model_entries(model, live).items() if k in metadata.state_dict_metadata}
        missing = sorted(k for k in live if f"model.{k}" not in metadata.state_dict_metadata)
        if missing and "buffers" in marker:  # checkpoints before buffers were saved have no such list
            raise ValueError(f"checkpoint {path} lacks the buffers {', '.join(missing[:5])}; load it into the "
                             "model it was saved from")  # fmt: skip
        if optimizer is not None:
            _check_optimizer(model, optimizer)
            if not marker.get("optimizer"):
                raise ValueError(f"checkpoint {path} has no optimizer state; load it with optimizer=None")
            _check_optimizer_state(model, metadata, path)
            optim_entries, states = _fresh_optimizer_entries(model, optimizer, metadata)
            entries.update(optim_entries)
    except (ValueError, OSError) as e:
        error = e
    raise_together(error, "load_checkpoint")
    dcp.load(entries, storage_reader=dcp.FileSystemReader(path))
    if optimizer is not None:
        _install_optimizer_state(model, optimizer, entries, states)
    with torch.no_grad():
        for b in model._flat_buffers:
            if b.trainable:
                b.sync_params()


def read_extra(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``extra`` state saved with a checkpoint (empty if none was); a complete checkpoint only."""
    path = Path(path)
    _read_marker(path)
    file = path / EXTRA
    return torch.load(file, weights_only=False) if file.is_file() else {}


def _digest(file: Path) -> list[int]:
    """[size in bytes, CRC-32] of a file, read in 4 MiB pieces."""
    crc = 0
    with file.open("rb") as f:
        while piece := f.read(4 << 20):
            crc = zlib.crc32(piece, crc)
    return [file.stat().st_size, crc]


def _check_files(path: Path, marker: dict[str, Any]) -> None:
    """Raises, naming the file, if a file the save recorded is missing, of another size or another checksum."""
    for name, (size, crc) in marker.get("files", {}).items():  # checkpoints before checksums have none
        file = path / name
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint file {file} is missing; load an earlier checkpoint")
        got = _digest(file)
        if got[0] != size:
            raise ValueError(f"checkpoint file {file} is truncated or was changed: {got[0]} bytes, {size} when "
                             "saved; load an earlier checkpoint")  # fmt: skip
        if got[1] != crc:
            raise ValueError(f"checkpoint file {file} is corrupted: its checksum differs from the one saved; load "
                             "an earlier checkpoint")  # fmt: skip


def _read_marker(path: Path) -> dict[str, Any]:
    if not (path / MARKER).is_file() or not (path / ".metadata").is_file():
        partial = path.with_name(path.name + ".partial")
        hint = f" ({partial} is an interrupted save)" if partial.exists() else ""
        raise FileNotFoundError(
            f"{path} is not a complete paro_torch checkpoint: {MARKER} or .metadata is missing{hint}; "
            "load an earlier checkpoint, or save again"
        )
    marker = json.loads((path / MARKER).read_text())
    if marker.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} has format {marker.get('format')}; this paro_torch reads {FORMAT}")
    return marker


def _check_compatible(model: ParoShardedModule, marker: dict[str, Any], metadata: Metadata, path: Path) -> None:
    saved: dict[str, list[int]] = marker["params"]
    mine = {k: list(p.shape) for k, p in _params(model).items()}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    common = set(mine) & set(saved)
    differ = sorted(f"{k}: checkpoint {saved[k]}, model {mine[k]}" for k in common if saved[k] != mine[k])
    if missing or unexpected or differ:
        parts = [
            f"{label} ({len(v)}): {', '.join(v[:5])}{', ...' if len(v) > 5 else ''}"
            for label, v in (("missing in checkpoint", missing), ("not in model", unexpected), ("shape", differ))
            if v
        ]
        raise ValueError(
            f"checkpoint {path} does not match the model: {'; '.join(parts)}; load it into the model it was "
            "saved from (same architecture and configuration)"
        )


def _check_optimizer_state(model: ParoShardedModule, metadata: Metadata, path: Path) -> None:
    """Either no trainable parameter has optimizer state (saved before the first step) or all have."""
    keys = {k.rsplit(".", 1)[0] for k in metadata.state_dict_metadata if k.startswith("optim.")}
    trainable = list(_trainable(model))
    absent = [fqn for fqn in trainable if f"optim.{fqn}" not in keys]
    if absent and len(absent) < len(trainable):
        raise ValueError(
            f"checkpoint {path} has no optimizer state for {', '.join(absent[:5])}: they were frozen when it "
            "was saved; freeze the same parameters, or load with optimizer=None"
        )


def _fresh_optimizer_entries(
    model: ParoShardedModule, optimizer: torch.optim.Optimizer, metadata: Metadata
) -> tuple[dict[str, Any], dict[int, dict[str, torch.Tensor | str]]]:
    """Load targets for the optimizer states in the checkpoint, shaped like this rank's parameter shards.

    Returns the DCP entries and, per parameter, each state's tensor (loaded in place) or its entry's key
    (scalars and objects, read back from the entries after loading).
    """
    md = metadata.state_dict_metadata
    entries: dict[str, Any] = {"optim.param_groups": None}
    states: dict[int, dict[str, torch.Tensor | str]] = {}
    for fqn, p in _trainable(model).items():
        first = f"optim.{fqn}."
        state: dict[str, torch.Tensor | str] = {}
        for key, kind in md.items():
            if not key.startswith(first) or "." in key[len(first) :]:
                continue
            name = key[len(first) :]
            if isinstance(kind, TensorStorageMetadata) and tuple(kind.size) == tuple(p.shape) and name != "step":
                state[name] = torch.zeros_like(p.detach(), dtype=kind.properties.dtype)
                entries[key] = state[name]
            else:
                state[name] = key
                entries[key] = (
                    torch.zeros(kind.size, dtype=kind.properties.dtype)
                    if isinstance(kind, TensorStorageMetadata)
                    else None
                )
        states[id(p)] = state
    return entries, states


def _install_optimizer_state(
    model: ParoShardedModule,
    optimizer: torch.optim.Optimizer,
    entries: dict[str, Any],
    states: dict[int, dict[str, torch.Tensor | str]],
) -> None:
    groups = entries["optim.param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(groups)} param groups, this one {len(optimizer.param_groups)}; "
            "build the optimizer with the same groups"
        )
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update(saved)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for p in _trainable(model).values():
        if states[id(p)]:
            state = {name: entries[v] if isinstance(v, str) else v for name, v in states[id(p)].items()}
            group = group_of.get(id(p), {})
            step = state.get("step")
            if torch.is_tensor(step) and (group.get("fused") or group.get("capturable")):
                # as Optimizer.load_state_dict: fused and capturable steps keep "step" on the parameter's device
                state["step"] = step.to(device=p.device, dtype=torch.float32)
            optimizer.state[p] = state


def export_safetensors(
    model: ParoShardedModule, path: str | os.PathLike[str], dtype: torch.dtype | None = None
) -> None:
    """Writes the whole model (the masters, or ``dtype``) as one safetensors file on rank 0; call on every rank."""
    from safetensors.torch import save_file

    full = model.full_state_dict(rank0_only=True)
    if dist.get_rank() == 0:
        tensors = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in full.items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"format": "pt", "paro_strategy": model.strategy.code})
    dist.barrier()
