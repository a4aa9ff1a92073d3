"""The strategy before sharding: the cost model's plan for ``auto``, or the check of an explicit strategy."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from paro_torch import _C
from paro_torch._engine.layout import G, I, N, param_rows
from paro_torch._engine.units import Entry
from paro_torch._groups import ParoGroups
from paro_torch._report import format_report
from paro_torch.api import Precision
from paro_torch.auto import (
    Link,
    LinkCalibration,
    choose_strategy,
    default_memory_budget,
    estimate,
    measure_links,
    model_flops,
    probe_model,
)

logger = logging.getLogger("paro_torch")


@dataclass
class Planned:
    """The strategy to shard with, and the plan behind it (None when nothing was planned)."""

    strategy: _C.Strategy
    plan: dict[str, Any] | None = None
    """The cost model's report (every strategy's memory, bytes, time)."""
    links: LinkCalibration | None = None
    """The link and throughput figures the plan used."""


def plan_strategy(
    module: nn.Module,
    parsed: _C.Strategy | None,
    cost_blocks: list[dict[str, Any]],
    groups: ParoGroups,
    device: torch.device,
    precision: Precision,
    *,
    memory_budget: int | None,
    grad_accum: int,
    clips_grad_norm: bool,
    tokens_per_micro_step: int | None,
    activation_checkpointing: bool | None,
    calibration: LinkCalibration | str | None,
    example_inputs: Any,
) -> Planned:
    """``parsed`` as given, or ``auto``'s pick (``parsed`` None); collective when anything is planned.

    An explicit strategy is planned (its memory checked against the budget, its step predicted) when it has a
    budget or link figures; links are measured for auto (or a model probe) alone, and the plan's times mean
    something only when link figures are given.
    """
    auto = parsed is None
    given = calibration is not None or bool(os.environ.get("PARO_CALIBRATION")) or example_inputs is not None
    if not (auto or memory_budget is not None or given):
        assert parsed is not None
        return Planned(parsed)
    budget = memory_budget if memory_budget is not None else default_memory_budget(groups.group_size)
    # the model probe runs one unsharded step on every rank: only for a model whose whole parameters and gradients
    # fit the budget; otherwise the stand-in probe's figures plan it (ranks decide alike: same sizes, same budget)
    whole = 2 * sum(b["numel"] for b in cost_blocks) * precision.param.itemsize
    timed = example_inputs is not None and whole <= budget
    if example_inputs is not None and not timed and groups.rank == 0:
        logger.warning(
            "paro: example_inputs are not timed: one unsharded step of the model holds %d bytes of parameters and "
            "gradients, over the memory budget of %d bytes per rank; the stand-in probe's throughputs plan it",
            whole,
            budget,
        )
    links = (
        resolve_links(calibration, groups, device, throughputs=not timed)
        if auto or given
        else LinkCalibration(Link(1e10, 1e-5), Link(1e9, 1e-5))
    )
    checkpointing = checkpointed(module) if activation_checkpointing is None else activation_checkpointing
    if timed:
        assert tokens_per_micro_step is not None  # checked by probe_problem
        # counted as the probe runs: a Trainer turns checkpointing on after wrapping
        flops = model_flops(cost_blocks, groups, tokens_per_micro_step, checkpointed(module))
        links = probe_model(links, groups, module, example_inputs, flops, device, dtype=precision.param)
    only = None if auto else parsed.code if parsed else None
    plan = estimate(
        cost_blocks,
        groups,
        links=links,
        memory_budget=budget,
        grad_accum=grad_accum,
        clip_grad_norm=clips_grad_norm,
        sizes=precision.bytes(),
        tokens_per_micro_step=tokens_per_micro_step,
        activation_checkpointing=checkpointing,
        only=only,
        shared_cores=device.type == "cpu",
    )
    code = choose_strategy(plan, groups, memory_budget=budget, only=only)
    if auto and groups.rank == 0:
        logger.info("paro: strategy='auto'\n%s", format_report(plan))
    return Planned(_C.Strategy(code), plan, links)


def checkpointed(module: nn.Module) -> bool:
    """Whether the model recomputes activations in backward: Hugging Face's flag or torch's checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return bool(getattr(module, "is_gradient_checkpointing", False)) or any(
        isinstance(m, CheckpointWrapper) for m in module.modules()
    )


def cost_blocks(units: list[list[Entry]], groups: ParoGroups) -> list[dict[str, Any]]:
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


def resolve_links(
    calibration: LinkCalibration | str | None, groups: ParoGroups, device: torch.device, throughputs: bool = True
) -> LinkCalibration:
    """Link figures: given, read from a file (argument or PARO_CALIBRATION), else measured now.

    A measurement includes the stand-in throughputs unless a model probe follows (``throughputs=False``).
    """
    if isinstance(calibration, LinkCalibration):
        return calibration
    path = calibration or os.environ.get("PARO_CALIBRATION")
    return LinkCalibration.load(path) if path else measure_links(groups, device=device, throughputs=throughputs)
