"""Re-predicts a training benchmark's cells with the installed cost model.

A training run records, per cell, the figures its own probe measured (``extra.links``; its overlap figures are
derived again from the probe's recorded loops where it has them) and the step time it measured. This rebuilds each
cell's cost-model request as the engine built it (the benchmark's model and scenario, units from the decoder layers,
the run's links; see ``_training_worker.py`` and ``ParoShardedModule``) and asks the cost model again, so a change to
the model can be checked against every measured cell in seconds instead of a new run. The output is the input JSON
with the predictions (and auto's picks) replaced; ``benchmarks/step_model.py`` reports on it. With an unchanged model
and probe the predictions must equal the recorded ones (``--check``).

    python3 benchmarks/repredict.py benchmarks/results/raw/training-2x2-1gbit-ilv8.json --out-dir /tmp/re [--check]

It needs a run's record (``training.py`` writes it to ``benchmarks/results/raw/``, git-ignored); the records of the
runs reported in ``benchmarks/JOURNAL.md`` are in git history (``git show c8abefb:benchmarks/results/NAME.json``),
one in ``tests/data/``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from paro_torch import auto
from paro_torch.api import Precision
from paro_torch.auto import LinkCalibration

sys.path.insert(0, str(Path(__file__).parent))
from _training_worker import apply_scenario, build_model, decoder_layer_class  # noqa: E402


class _Shape:
    """The two numbers of a ``ParoGroups`` that sizes depend on."""

    def __init__(self, world: int, group_size: int) -> None:
        self.world, self.group_size = world, group_size
        self.num_groups = world // group_size


def blocks_of(cfg: dict[str, Any], scenario: str, groups: _Shape) -> list[dict[str, Any]]:
    """The cost model's units for the benchmark's model in ``scenario`` (built on the meta device)."""
    with torch.device("meta"):
        model, _ = apply_scenario(build_model(cfg), dict(cfg, scenario=scenario))
    return auto.cost_blocks(model, {decoder_layer_class()}, groups.world, groups.group_size)


def estimate(
    blocks: list[dict[str, Any]],
    groups: _Shape,
    cfg: dict[str, Any],
    links: LinkCalibration,
    only: str | None,
    shared_cores: bool = True,
) -> dict[str, Any]:
    """The cost model's report for a benchmark cell (CPU ranks: ``shared_cores``), as the engine asks for it."""
    tokens = cfg["micro_batch"] * cfg["model"]["seq"]
    return auto.estimate(blocks, groups, links=links, memory_budget=1 << 62, grad_accum=cfg["grad_accum"],
                         clip_grad_norm=cfg["clip"] > 0, sizes=Precision().bytes(), tokens_per_micro_step=tokens,
                         only=only, shared_cores=shared_cores)  # fmt: skip


def repredict(
    result: dict[str, Any], overrides: dict[str, float], shared_cores: bool = True
) -> tuple[dict[str, Any], float]:
    """``result`` with every paro cell's prediction from the installed model; the largest change in step_s."""
    out = copy.deepcopy(result)
    cfg = out["config"]
    groups = _Shape(cfg["world"], cfg["per_node"])
    blocks: dict[str, list[dict[str, Any]]] = {}
    largest = 0.0
    for run in out["runs"]:
        extra = run.get("extra") or {}
        if not run.get("ok") or "links" not in extra or not run["variant"].startswith("paro:"):
            continue
        if run["scenario"] not in blocks:
            blocks[run["scenario"]] = blocks_of(cfg, run["scenario"], groups)
        known = LinkCalibration.record_keys()  # a record may carry figures a later probe no longer takes
        links = LinkCalibration.from_record({k: v for k, v in extra["links"].items() if k in known})
        if links.overlap_loops is not None:  # the overlap figures as the installed probe derives them
            links = auto.overlaps_from_loops(links, groups)
        links = links.replace_figures(**overrides)
        is_auto = run["variant"] == "paro:auto"
        only = None if is_auto else extra["strategy"]
        report = estimate(blocks[run["scenario"]], groups, cfg, links, only, shared_cores)
        mine = next(s for s in report["strategies"] if s["code"] == extra["strategy"])
        old = extra["predicted"]["step"]["step_s"]
        largest = max(largest, abs(mine["step"]["step_s"] - old) / old)
        extra["predicted"].update(time_s=mine["time_s"], step=mine["step"])
        if is_auto:
            extra["auto_choice"] = report["choice"]["code"] if report.get("choice") else None
    return out, largest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="+", help="training benchmark JSON files")
    ap.add_argument("--out-dir", type=Path, required=True, help="where the re-predicted JSON files go (same names)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a LinkCalibration figure in every cell, e.g. intra_slowdown=6")  # fmt: skip
    ap.add_argument("--check", action="store_true", help="fail unless the predictions equal the recorded ones")
    ap.add_argument("--no-shared-cores", action="store_true",
                    help="predict as for ranks that do not share cores (GPUs)")  # fmt: skip
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in LinkCalibration.record_keys():
            ap.error(f"--set {item}: {name!r} is not a LinkCalibration field")
        overrides[name] = float(value)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for path in args.results:
        result, largest = repredict(json.loads(path.read_text()), overrides, not args.no_shared_cores)
        (args.out_dir / path.name).write_text(json.dumps(result, indent=1) + "\n")
        print(f"{path.name}: largest change of a predicted step {largest:.2%}")
        if args.check and not math.isclose(largest, 0.0, abs_tol=1e-9):
            print("the installed cost model does not reproduce the recorded predictions", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
