"""Training benchmark on an emulated multi-node cluster: paro_torch (14 strategies, auto) vs DDP, FSDP, DeepSpeed.

A LLaMA-style model (transformers LlamaForCausalLM from a config, random weights, nothing downloaded) trains for a
few steps with gradient accumulation in three scenarios: full-parameter, partial (about 1/16 of the parameters
trainable) and LoRA (adapters on q/k/v/o only). Every variant runs in its own launch (one torchrun per node inside
its namespace of the testbed, see benchmarks/testbed.sh), from the same initial weights on the same data; with
``--interleave`` the paro variants of a scenario share one launch and take their measured steps in turns. Per run:
step time, samples/s, bytes that crossed the inter-node links per step (/proc/net/dev of each node's veth), peak RSS
per rank, the loss; for paro also the cost model's predicted communication time per step with link figures that
``paro_torch.calibrate()`` measured on the same testbed at the start. Writes the tables to
benchmarks/results/training-<K>x<M>-<rate>.md, one .png per scenario, the per-variant summary (what the tables and
``step_model.py`` read) to ``.summary.json`` beside them, and the record (every rank's figures, the probes') to
benchmarks/results/raw/training-<K>x<M>-<rate>.json (git-ignored; ``repredict.py`` reads it).

    sudo python3 benchmarks/training.py --nodes 2 --per-node 2 --rate 1gbit --repeats 2
    python3 benchmarks/training.py --no-testbed --steps 3 --scenarios lora --only paro:IIG,ddp   # localhost, no root
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _testbed import (
    ERROR_MARK,
    HERE,
    LaunchError,
    Testbed,
    base_env,
    exit_on_sigterm,
    ext,
    link_info,
    machine_info,
    require_root,
    run_launch,
    torchrun_commands,
)

import paro_torch

WORKER = HERE / "_training_worker.py"
SCENARIOS = ("full", "partial", "lora")
PARO_STRATEGIES = tuple(paro_torch.STRATEGIES)  # the 14 valid (p, g, os) codes
SECONDARY_ERRORS = re.compile(
    r"connection (closed|reset|refused)|broken pipe|peer|timed out|timeout|signal|SIGTERM|ChildFailedError", re.I
)


@dataclass(frozen=True)
class Variant:
    """A system configuration: the name (``system:option``) and what it is."""

    name: str
    about: str

    @property
    def system(self) -> str:
        return self.name.partition(":")[0]


def _variants() -> dict[str, Variant]:
    out = [Variant("paro:auto", "ParoShardedModule, strategy='auto' (cost model with the calibrated links)")]
    out += [Variant(f"paro:{c}", f"ParoShardedModule, strategy {c}") for c in PARO_STRATEGIES]
    out += [
        Variant("ddp", "torch DistributedDataParallel"),
        Variant("fsdp1:FULL_SHARD", "FSDP1 FULL_SHARD"),
        Variant("fsdp1:SHARD_GRAD_OP", "FSDP1 SHARD_GRAD_OP"),
        Variant("fsdp1:HYBRID_SHARD", "FSDP1 HYBRID_SHARD, 2-D mesh (nodes, per-node)"),
        Variant("fsdp1:_HYBRID_SHARD_ZERO2", "FSDP1 _HYBRID_SHARD_ZERO2, 2-D mesh (nodes, per-node)"),
        Variant("fsdp2", "FSDP2 fully_shard, 1-D mesh"),
        Variant("fsdp2:hsdp", "FSDP2 fully_shard, 2-D mesh (nodes, per-node): HSDP"),
        Variant("deepspeed:zero2", "DeepSpeed ZeRO-2"),
        Variant("deepspeed:zero3", "DeepSpeed ZeRO-3 (persistence threshold 0, max live / reuse distance 0)"),
        Variant("deepspeed:hpz", "DeepSpeed ZeRO++ hpZ: ZeRO-3 + zero_hpz_partition_size = per-node"),
        Variant("deepspeed:mics", "DeepSpeed MiCS: ZeRO-3 + mics_shard_size = per-node"),
    ]
    return {v.name: v for v in out}


VARIANTS = _variants()


# ------------------------------------------------------------------------------------------------- launching
def worker_config(args: argparse.Namespace, **fields: Any) -> dict[str, Any]:
    """What every launch of this benchmark shares, plus ``fields`` (mode, variant, scenario, ...)."""
    return {
        "nodes": args.nodes,
        "per_node": args.per_node,
        "model": model_config(args),
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "steps": args.steps,
        "warmup": args.warmup,
        "lr": args.lr,
        "clip": 1.0,
        "seed": 0,
        "data_seed": 1234,
        "lora_r": args.lora_r,
        "partial_fraction": 1 / 16,
        "timeout_s": args.timeout,
        **fields,
    }


def model_config(args: argparse.Namespace) -> dict[str, int]:
    """The LlamaConfig sizes chosen on the command line."""
    return {
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "vocab": args.vocab,
        "seq": args.seq,
    }


def launch_worker(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    stem: str,
    env: dict[str, str],
    port: int,
    logdir: Path,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    """One launch of the worker with ``cfg`` (limit: ``timeout``, default ``--run-timeout``); returns its records
    (raises LaunchError)."""
    logdir.mkdir(parents=True, exist_ok=True)
    cfg_path = logdir / f"{stem}.config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    script = [str(WORKER), "--bench-config", str(cfg_path)]
    cmds = torchrun_commands(args.nodes, args.per_node, script, base_env(args.per_node, env), port, args.no_testbed)
    return run_launch(stem, cmds, logdir, timeout or args.run_timeout, log_stem=stem)


def failure_reason(err: LaunchError) -> str:
    """The first error a rank reported (a primary one if there is one), else the tail of the message."""
    if err.timed_out:
        return f"timeout: {str(err).splitlines()[0]}"
    found: list[str] = []
    for path in err.logs:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        found += [ln.split(ERROR_MARK, 1)[1].strip() for ln in text.splitlines() if ERROR_MARK in ln]
    primary = [f for f in found if not SECONDARY_ERRORS.search(f)]
    if primary or found:
        return (primary or found)[0]
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errs[-1] if errs else lines[0]).strip()[:600]


def run_calibration(args: argparse.Namespace, port: int, logdir: Path) -> dict[str, Any]:
    """``paro_torch.calibrate()`` on this layout; returns the path and figures (or the error)."""
    path = logdir / "calibration.json"
    cfg = worker_config(args, mode="calibrate", calibration_path=str(path))
    start = time.time()
    try:
        recs = launch_worker(args, cfg, "calibration", {}, port, logdir)
    except LaunchError as e:
        return {"ok": False, "reason": failure_reason(e), "wall_s": time.time() - start}
    rec = next(r for r in recs if r["kind"] == "calibration")
    return {"ok": True, "path": str(path), "links": rec["links"], "wall_s": round(time.time() - start, 1)}


def _calibration_env(calibration: dict[str, Any]) -> dict[str, str]:
    """The environment that points a paro launch at the layout's calibration (none where it failed)."""
    return {"PARO_CALIBRATION": calibration["path"]} if calibration.get("ok") else {}


def run_variant(
    args: argparse.Namespace,
    scenario: str,
    variant: Variant,
    repeat: int,
    calibration: dict[str, Any],
    port: int,
    logdir: Path,
) -> dict[str, Any]:
    """One launch of one variant in one scenario; returns the run record (``ok`` False with a reason on failure)."""
    stem = f"{scenario}.{variant.name.replace(':', '-')}.r{repeat + 1}"
    env = _calibration_env(calibration) if variant.system == "paro" else {}
    if variant.system == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    cfg = worker_config(args, mode="train", variant=variant.name, scenario=scenario)
    start = time.time()
    base = {"scenario": scenario, "variant": variant.name, "repeat": repeat}
    try:
        recs = launch_worker(args, cfg, stem, env, port, logdir)
    except LaunchError as e:
        return {**base, "ok": False, "reason": failure_reason(e), "wall_s": round(time.time() - start, 1)}
    run = next(r for r in recs if r["kind"] == "run")
    run.pop("kind")
    return {**base, **run, "ok": True, "wall_s": round(time.time() - start, 1)}


def run_interleaved(
    args: argparse.Namespace,
    scenario: str,
    names: list[str],
    repeat: int,
    calibration: dict[str, Any],
    port: int,
    logdir: Path,
) -> list[dict[str, Any]]:
    """One launch of the paro variants ``names`` in one scenario, their steps in turns (``--interleave``).

    Returns a run record per variant, as ``run_variant`` does (all failed, with the reason, if the launch failed).
    """
    stem = f"{scenario}.paro-interleaved.r{repeat + 1}"
    env = _calibration_env(calibration)
    cfg = worker_config(args, mode="interleave", variants=names, scenario=scenario)
    start = time.time()
    try:
        recs = launch_worker(args, cfg, stem, env, port, logdir, timeout=args.run_timeout * len(names))
    except LaunchError as e:
        wall = round(time.time() - start, 1)
        reason = failure_reason(e)
        return [{"scenario": scenario, "variant": n, "repeat": repeat, "ok": False, "reason": reason, "wall_s": wall}
                for n in names]  # fmt: skip
    wall = round((time.time() - start) / len(names), 1)  # the launch's time, shared out
    found = {r["variant"]: r for r in recs if r["kind"] == "run"}
    runs = []
    for name in names:
        base = {"scenario": scenario, "variant": name, "repeat": repeat, "wall_s": wall}
        rec = found.get(name)
        if rec is None:
            runs.append({**base, "ok": False, "reason": "the interleaved launch ended without this variant's record"})
            continue
        rec.pop("kind")
        runs.append({**base, **rec, "ok": True})
    return runs


# -------------------------------------------------------------------------------------------------- numbers
def inter_bytes_per_step(run: dict[str, Any]) -> float | None:
    """Sum over nodes of the veth's tx bytes during the measured steps, minus the barriers' own bytes, per step."""
    total = 0
    seen = False
    for n in run.get("nodes") or []:
        iface = f"veth-n{n['node']}"
        if iface in n["delta"]:
            seen = True
            total += n["delta"][iface]["tx"] - n["overhead"].get(iface, {"tx": 0})["tx"]
    return total / run["steps"] if seen else None


def counted_inter_per_step(run: dict[str, Any]) -> float | None:
    """Inter-level bytes all ranks sent on paro's groups per step, as paro_torch.comm_stats counts them."""
    if not run.get("counted"):
        return None
    return sum(c["inter_bytes"] for c in run["counted"]) / run["steps"]


def heap_growth(run: dict[str, Any]) -> float | None:
    """Max over ranks of (peak live heap bytes - live heap bytes before the model was built)."""
    heaps = [h for h in run.get("heap_per_rank") or [] if h]
    return max(h["peak"] - h["start"] for h in heaps) if heaps else None


def global_samples(args_or_cfg: dict[str, Any]) -> int:
    """Samples per optimizer step over all ranks."""
    return args_or_cfg["world"] * args_or_cfg["micro_batch"] * args_or_cfg["grad_accum"]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def phase_means(run: dict[str, Any]) -> dict[str, float]:
    """Milliseconds per step in each phase of one run, mean over ranks."""
    ranks = run["phases_ms_per_rank"]
    return {k: statistics.fmean(r.get(k, 0.0) for r in ranks) for k in ranks[0]}


def comm_seconds_means(run: dict[str, Any]) -> dict[str, float]:
    """Seconds per step the engine's communication threads spent in each "<collective> <level>", mean over ranks."""
    ranks = run["comm_seconds_per_rank"]
    kinds = sorted({k for r in ranks for k in r})
    return {k: statistics.fmean(r.get(k, 0.0) for r in ranks) for k in kinds}


def summarize(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per scenario, one row per variant over its repeats (medians), in the order of VARIANTS."""
    cf = result["config"]
    samples = global_samples(cf)
    out: dict[str, list[dict[str, Any]]] = {}
    for scenario in cf["scenarios"]:
        rows = []
        for name in cf["variants"]:
            runs = [r for r in result["runs"] if r["scenario"] == scenario and r["variant"] == name]
            if not runs:
                continue
            ok = [r for r in runs if r["ok"]]
            row: dict[str, Any] = {
                "variant": name,
                "ok": bool(ok),
                "repeats": len(runs),
                "failed": [r["reason"] for r in runs if not r["ok"]],
                "step_s_per_repeat": [r["step_ms_median"] / 1e3 if r["ok"] else None for r in runs],
            }
            if ok:
                step = statistics.median(r["step_ms_median"] for r in ok) / 1e3
                inter = [x for x in (inter_bytes_per_step(r) for r in ok) if x is not None]
                counted = [x for x in (counted_inter_per_step(r) for r in ok) if x is not None]
                first = ok[0]
                row.update(
                    step_s=step,
                    samples_per_s=samples / step,
                    inter_bytes_per_step=_median(inter),
                    inter_bytes_per_step_per_repeat=inter,
                    counted_inter_bytes_per_step=_median(counted),
                    peak_rss_max=_median([max(r["peak_rss_per_rank"]) for r in ok if r.get("peak_rss_per_rank")]),
                    peak_heap_max=_median([heap_growth(r) for r in ok if heap_growth(r) is not None]),
                    loss=first["loss"],
                    loss_per_repeat=[r["loss"] for r in ok],
                    model=first["model"],
                )
                phases = [phase_means(r) for r in ok if r.get("phases_ms_per_rank")]
                if phases:  # seconds per step in each phase: mean over ranks, median over repeats
                    row["phases_s"] = {k: statistics.median(p[k] for p in phases) / 1e3 for k in phases[0]}
                busy = [comm_seconds_means(r) for r in ok if r.get("comm_seconds_per_rank")]
                if busy:  # the same statistics for the engine's time in collectives, per kind
                    row["comm_seconds"] = {k: statistics.median(b.get(k, 0.0) for b in busy) for k in busy[0]}
                if first.get("memory_stats_per_rank"):
                    row["model_states_max"] = max(sum(m.values()) for m in first["memory_stats_per_rank"])
                ex = first.get("extra") or {}
                if "predicted" in ex:  # each launch calibrates its own compute: the median over repeats
                    predicted = [r["extra"]["predicted"] for r in ok if "predicted" in (r.get("extra") or {})]
                    steps = [x["step"] for x in predicted if x.get("step")]
                    row["strategy"] = ex["strategy"]
                    row["predicted_time_s"] = statistics.median(x["time_s"] for x in predicted)
                    median_step = {k: statistics.median(s[k] for s in steps) for k in steps[0]} if steps else None
                    row["predicted_step"] = median_step
                    row["predicted_inter_bytes"] = ex["predicted"]["inter_bytes_per_rank"] * cf["world"]
                if "auto_choice" in ex:
                    row["auto_choices"] = [r["extra"]["auto_choice"] for r in ok]
                    row["auto_choice"] = max(row["auto_choices"], key=row["auto_choices"].count)
                    row["auto_reason"] = ex.get("auto_reason")
            rows.append(row)
        out[scenario] = rows
    return out


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation: Pearson's correlation of the ranks (None below 3 points or without spread)."""
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx > 0 and vy > 0 else None


TOLERANCE = 0.20  # the step model's target: predicted within 20 % of measured
AUTO_SLACK = 0.05  # auto's pick within 5 % of the fastest measured strategy
STEP_PARTS = ("compute_s", "exposed_intra_s", "exposed_inter_s", "exposed_global_s", "interference_s", "optimizer_s")


def predicted_step_s(row: dict[str, Any]) -> float:
    """The cost model's step time (the communication-only time for runs from before the step model)."""
    step = row.get("predicted_step")
    return step["step_s"] if step and step.get("step_s") else row["predicted_time_s"]


def prediction(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Predicted against measured step time for the explicit paro strategies, and auto's pick."""
    paro = [r for r in rows if r["ok"] and r["variant"] != "paro:auto" and "predicted_time_s" in r]
    pred = [predicted_step_s(r) for r in paro]
    meas = [r["step_s"] for r in paro]
    table = []
    for r, p, a, b in zip(paro, pred, ranks(pred), ranks(meas), strict=True):
        table.append(
            {
                "strategy": r["strategy"],
                "predicted_step_s": p,
                "predicted_step": r.get("predicted_step"),
                "predicted_time_s": r["predicted_time_s"],
                "predicted_inter_bytes": r["predicted_inter_bytes"],
                "inter_bytes_per_step": r.get("inter_bytes_per_step"),
                "counted_inter_bytes_per_step": r.get("counted_inter_bytes_per_step"),
                "comm_seconds": r.get("comm_seconds"),
                "step_s": r["step_s"],
                "error": p / r["step_s"] - 1,
                "predicted_rank": a,
                "measured_rank": b,
            }
        )
    within = sum(abs(t["error"]) <= TOLERANCE for t in table)
    out: dict[str, Any] = {
        "table": table,
        "n": len(paro),
        "spearman_time": spearman(pred, meas),
        "within_tolerance": within,
        "within_tolerance_frac": within / len(table) if table else None,
    }
    inter = [(r["predicted_inter_bytes"], r["inter_bytes_per_step"]) for r in paro if r.get("inter_bytes_per_step")]
    if inter:
        out["spearman_inter_bytes"] = spearman([a for a, _ in inter], [b for _, b in inter])
    pairs = [(r["predicted_inter_bytes"], r["counted_inter_bytes_per_step"]) for r in paro
             if r.get("counted_inter_bytes_per_step") is not None]  # fmt: skip
    if pairs:  # the engine's own count vs the cost model's bytes: should agree to the byte
        out["counted_vs_predicted_inter_max_rel_diff"] = max(abs(c - p) / max(p, 1.0) for p, c in pairs)
    fastest = min(paro, key=lambda r: r["step_s"]) if paro else None
    out["fastest_measured"] = fastest["strategy"] if fastest else None
    out["fastest_measured_step_s"] = fastest["step_s"] if fastest else None
    auto = next((r for r in rows if r["variant"] == "paro:auto" and r["ok"]), None)
    if auto is not None:
        choice = auto.get("auto_choice")
        out["auto_choice"] = choice
        out["auto_choices"] = auto.get("auto_choices", [choice])
        out["auto_step_s"] = auto["step_s"]
        out["auto_reason"] = auto.get("auto_reason")
        pick = next((t for t in table if t["strategy"] == choice), None)
        out["auto_choice_measured_rank"] = pick["measured_rank"] if pick else None
        out["auto_picked_fastest"] = (choice == out["fastest_measured"]) if pick else None
        picks = [t for t in table if t["strategy"] in out["auto_choices"]]
        if picks and fastest:  # the picks' own explicit runs against the fastest one (the slowest pick, if several)
            out["auto_pick_vs_fastest"] = max(t["step_s"] for t in picks) / fastest["step_s"]
            out["auto_within_slack"] = out["auto_pick_vs_fastest"] <= 1 + AUTO_SLACK
    return out


# -------------------------------------------------------------------------------------------------- reports
def _f(x: float | None, fmt: str = "{:.3f}", missing: str = "–") -> str:
    return missing if x is None else fmt.format(x)


def _mb(x: float | None) -> str:
    return _f(None if x is None else x / 1e6, "{:.2f}")


def _mib(x: float | None, fmt: str) -> str:
    return _f(None if x is None else x / 2**20, fmt)


def markdown(result: dict[str, Any]) -> str:
    """The report: settings, one table per scenario, then the prediction check per scenario."""
    mi, cf, link = result["machine"], result["config"], result["link"]
    cal = result.get("calibration") or {}
    mc = cf["model"]
    lines = [
        f"# Training, {cf['nodes']} nodes x {cf['per_node']} ranks, {link['description']}",
        "",
        f"- machine: {mi['nproc']} cores ({mi['cpu']}), {mi['memory_bytes'] / 2**30:.0f} GiB, kernel {mi['kernel']}, "
        f"load average at start {', '.join(f'{x:.2f}' for x in mi['loadavg_at_start'])}; torch {mi['torch']}, "
        f"transformers {mi.get('transformers')}, peft {mi.get('peft')}, deepspeed {mi.get('deepspeed')}, "
        f"paro-torch {mi['paro_torch']} (commit {mi['git_commit'][:10]}{', dirty' if mi['git_dirty'] else ''}); "
        f"{mi['time']}; {mi.get('wall_s', '?')} s in all",
        f"- model: LlamaForCausalLM, hidden {mc['hidden']}, intermediate {mc['intermediate']}, {mc['layers']} layers, "
        f"{mc['heads']} heads ({mc['kv_heads']} kv), vocab {mc['vocab']}, untied embeddings, random init (seed 0); "
        f"fp32; AdamW lr {cf['lr']}, clip 1.0",
        f"- data: random token ids, sequence {mc['seq']}, micro-batch {cf['micro_batch']} per rank, "
        f"{cf['grad_accum']} micro-batches per step ({global_samples(cf)} samples per step over {cf['world']} ranks); "
        f"{cf['warmup']} warm-up + {cf['steps']} measured steps per run, {cf['repeats']} run(s) per variant",
        "- step time: per step the max over ranks (barrier before each step), median over the measured steps; "
        "the table shows the median over repeats and each repeat's value",
        "- inter-node MB/step: sum over nodes of the node veth's tx bytes (/proc/net/dev, headers and ACKs "
        "included) during the measured steps, minus the same barriers without a step, per step; paro counted: "
        "inter-level payload bytes all ranks sent on paro's groups (paro_torch.comm_stats)",
        "- peak heap: max over ranks of glibc's live heap bytes (mallinfo2, sampled every 5 ms) at peak minus before "
        "the model was built (so it includes the whole model each rank builds before wrapping); peak RSS: max over "
        "ranks of getrusage's ru_maxrss (also libraries and what the allocator keeps after frees); model states: "
        "ParoShardedModule.memory_stats(opt), max over ranks (MB = MiB here)",
        "- loss: the last step's loss, mean over ranks (the same global batch for every variant)",
    ]
    if cf.get("note"):
        lines.append(f"- note: {cf['note']}")
    if cal.get("ok"):
        lk = cal["links"]
        lines.append(
            f"- link calibration (paro_torch.calibrate on this layout, PARO_CALIBRATION for every paro run): intra "
            f"{lk['intra_bandwidth'] / 1e6:.0f} MB/s, {lk['intra_latency'] * 1e6:.0f} µs; inter "
            f"{lk['inter_bandwidth'] / 1e6:.0f} MB/s, {lk['inter_latency'] * 1e6:.0f} µs"
        )
    elif cal:
        lines.append(f"- link calibration failed ({cal.get('reason')}): paro runs measured the links themselves")
    for scenario, rows in result["summary"].items():
        model = next((r["model"] for r in rows if r.get("model")), None)
        lines += ["", f"## {scenario}", ""]
        if model:
            extra = ""
            if model.get("partial_kinds"):
                extra = f"; trainable: {', '.join(model['partial_kinds'])} of every decoder layer"
            if model.get("lora"):
                lo = model["lora"]
                extra = f"; LoRA r {lo['r']}, alpha {lo['alpha']} on {', '.join(lo['targets'])}"
            lines.append(
                f"{model['params'] / 1e6:.3f}M parameters, {model['trainable'] / 1e6:.3f}M trainable "
                f"(Ψ'/Ψ = 1/{model['params'] / max(model['trainable'], 1):.1f}){extra}."
            )
            lines.append("")
        lines += [
            "| variant | step s | step s per repeat | samples/s | inter-node MB/step | paro counted inter MB/step "
            "| peak heap MB | peak RSS MB | model states MB | loss |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            reps = ", ".join(_f(x, "{:.3f}", "failed") for x in r["step_s_per_repeat"])
            if not r["ok"]:
                reason = r["failed"][0].replace("|", "/")[:160]
                lines.append(f"| {r['variant']} | failed | {reps} | – | – | – | – | – | – | {reason} |")
                continue
            name = r["variant"] + (f" → {r['auto_choice']}" if r.get("auto_choice") else "")
            lines.append(
                f"| {name} | {r['step_s']:.3f} | {reps} | {r['samples_per_s']:.2f} | {_mb(r['inter_bytes_per_step'])} "
                f"| {_mb(r.get('counted_inter_bytes_per_step'))} | {_mib(r.get('peak_heap_max'), '{:.0f}')} "
                f"| {_mib(r.get('peak_rss_max'), '{:.0f}')} "
                f"| {_mib(r.get('model_states_max'), '{:.1f}')} | {r['loss']:.5f} |"
            )
        losses = [r["loss"] for r in rows if r["ok"]]
        if losses:
            lines += ["", f"Losses over all variants: {min(losses):.5f} .. {max(losses):.5f}."]
        phased = [r for r in rows if r.get("phases_s")]
        if phased:
            names = list(dict.fromkeys(k for r in phased for k in r["phases_s"]))
            lines += [
                "",
                f"### {scenario}: where a step's time goes (s per step, summed over its micro-steps; mean over ranks)",
                "",
                "| variant | " + " | ".join(names) + " |",
                "|---|" + "---:|" * len(names),
            ]
            for r in phased:
                cells = " | ".join(_f(r["phases_s"].get(k), "{:.3f}", "–") for k in names)
                lines.append(f"| {r['variant']} | {cells} |")
        pc = result["predictions"].get(scenario)
        if pc and pc["n"]:
            lines += [
                "",
                f"### {scenario}: cost model vs measurement (paro strategies)",
                "",
                "Predicted step and its parts (s): compute, communication compute waits for per level (exposed), "
                "what collectives beside compute cost it (interference), optimizer; comm = every collective's time "
                "with nothing overlapped.",
                "",
                "| strategy | predicted step | compute | exposed intra | exposed inter | exposed global | interference "
                "| optimizer | measured step | error | comm | predicted inter MB | paro counted inter MB "
                "| inter-node MB | predicted rank | measured rank |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for t in sorted(pc["table"], key=lambda t: t["predicted_step_s"]):
                st = t.get("predicted_step") or {}
                parts = " | ".join(_f(st.get(k)) for k in STEP_PARTS)
                lines.append(
                    f"| {t['strategy']} | {t['predicted_step_s']:.3f} | {parts} | {t['step_s']:.3f} "
                    f"| {t['error']:+.0%} | {t['predicted_time_s']:.3f} | {_mb(t['predicted_inter_bytes'])} "
                    f"| {_mb(t['counted_inter_bytes_per_step'])} | {_mb(t['inter_bytes_per_step'])} "
                    f"| {t['predicted_rank']:g} | {t['measured_rank']:g} |"
                )
            lines += [
                "",
                f"- predicted within {TOLERANCE:.0%} of measured: {pc['within_tolerance']} of {pc['n']} strategies",
                f"- Spearman ρ (predicted vs measured step time, {pc['n']} strategies): "
                f"{_f(pc['spearman_time'], '{:.2f}', 'n/a')}"
                + (
                    f"; predicted vs measured inter-node bytes: {_f(pc['spearman_inter_bytes'], '{:.2f}', 'n/a')}"
                    if "spearman_inter_bytes" in pc
                    else ""
                ),
                f"- fastest measured: {pc['fastest_measured']} ({pc['fastest_measured_step_s']:.3f} s/step)",
            ]
            if "counted_vs_predicted_inter_max_rel_diff" in pc:
                lines.append(
                    "- paro counted inter bytes vs the cost model's: largest relative difference "
                    f"{pc['counted_vs_predicted_inter_max_rel_diff']:.2e}"
                )
            if "auto_choice" in pc:
                verdict = {True: "yes", False: "no", None: "its pick was not measured here"}[pc["auto_picked_fastest"]]
                rank = pc.get("auto_choice_measured_rank")
                lines.append(
                    f"- auto picked {pc['auto_choice']} (its own run: {pc['auto_step_s']:.3f} s/step, "
                    f"{pc['auto_step_s'] / pc['fastest_measured_step_s']:.2f}x the fastest measured"
                    + (f"; {pc['auto_choice']}'s run ranks {rank:g} of {pc['n']}" if rank else "")
                    + f"); the fastest measured? {verdict}"
                    + (
                        f"; its explicit run is {pc['auto_pick_vs_fastest']:.3f}x the fastest (target "
                        f"≤ {1 + AUTO_SLACK:.2f}x)"
                        if "auto_pick_vs_fastest" in pc
                        else ""
                    )
                )
    lines += ["", "Variants:", ""] + [f"- `{v}`: {VARIANTS[v].about}" for v in cf["variants"] if v in VARIANTS]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], base: Path) -> list[Path]:
    """One PNG per scenario: samples/s and inter-node MB/step per variant (empty list without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    colors = {"paro": "tab:blue", "ddp": "tab:gray", "fsdp1": "tab:orange", "fsdp2": "tab:green",
              "deepspeed": "tab:red"}  # fmt: skip
    cf = result["config"]
    paths = []
    for scenario, rows in result["summary"].items():
        if not rows:
            continue
        has_bytes = any(r.get("inter_bytes_per_step") is not None for r in rows)
        nrow = 2 if has_bytes else 1
        fig, axes = plt.subplots(
            nrow, 1, figsize=(max(8, 0.45 * len(rows) + 2), 2.6 * nrow + 1.4), squeeze=False, sharex=True
        )
        xs = list(range(len(rows)))
        names = [r["variant"] + (f"→{r['auto_choice']}" if r.get("auto_choice") else "") for r in rows]
        col = [colors.get(VARIANTS[r["variant"]].system, "black") for r in rows]
        ax = axes[0][0]
        ax.bar(xs, [r.get("samples_per_s") or 0 for r in rows], color=col)
        for i, r in enumerate(rows):
            reps = [global_samples(cf) / s for s in r["step_s_per_repeat"] if s]
            ax.plot([i] * len(reps), reps, "k.", ms=4)
            if not r["ok"]:
                ax.text(i, 0, "failed", rotation=90, ha="center", va="bottom", fontsize=7, color="red")
        ax.set_ylabel("samples/s (dots: repeats)")
        if has_bytes:
            ax2 = axes[1][0]
            mbs = [(r.get("inter_bytes_per_step") or 0) / 1e6 for r in rows]
            ax2.bar(xs, mbs, color=col)
            for i, v in enumerate(mbs):
                if v > 0:
                    ax2.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
            positive = [v for v in mbs if v > 0]
            if positive and max(positive) > 30 * min(positive):
                ax2.set_yscale("log")
            ax2.set_ylabel("inter-node MB / step")
        for a in axes[:, 0]:
            a.grid(axis="y", alpha=0.3)
        axes[-1][0].set_xticks(xs, names, rotation=70, ha="right", fontsize=8)
        fig.suptitle(f"training, {scenario}: {cf['nodes']} nodes x {cf['per_node']} ranks, "
                     f"{result['link']['description']}")  # fmt: skip
        fig.tight_layout()
        path = ext(base, f"-{scenario}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


SUMMARY_KEYS = ("machine", "link", "config", "calibration", "summary")


def write_reports(result: dict[str, Any], base: Path, raw: Path) -> None:
    """Summaries and predictions into ``raw`` (the record); <base>.summary.json, <base>.md and the plots."""
    result["summary"] = summarize(result)
    result["predictions"] = {s: prediction(rows) for s, rows in result["summary"].items()}
    raw.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: result[k] for k in SUMMARY_KEYS if k in result}  # the predictions follow from it (prediction())
    ext(base, ".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = markdown(result)
    ext(base, ".md").write_text(md)
    print(f"wrote {raw}, {ext(base, '.summary.json')}, {ext(base, '.md')}")
    for p in plot(result, base):
        print(f"wrote {p}")
    print("\n" + md)


# -------------------------------------------------------------------------------------------------- command
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="emulated nodes K (namespaces)")
    ap.add_argument("--per-node", type=int, default=2, help="ranks per node M (= paro's group size)")
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate of every link, both directions")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, from: " + ", ".join(SCENARIOS))
    ap.add_argument("--only", default="*", help="variants, comma-separated; shell patterns allowed (paro:*, fsdp*)")
    ap.add_argument("--skip", default="", help="variants to leave out, comma-separated; patterns allowed")
    ap.add_argument("--repeats", type=int, default=2, help="launches per variant and scenario")
    ap.add_argument("--steps", type=int, default=5, help="measured optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="optimizer steps before the measured ones (3: see README)")
    ap.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per micro-batch")
    ap.add_argument("--seq", type=int, default=128, help="sequence length")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-testbed", "--dry-run", action="store_true", help="plain localhost, one torchrun, no root")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results", help="where the results go")
    ap.add_argument("--suffix", default="", help="appended to the output names (training-2x2-1gbit-SUFFIX.*)")
    ap.add_argument("--port", type=int, default=29611, help="first master port (testbed mode)")
    ap.add_argument("--timeout", type=int, default=180, help="process-group timeout (s)")
    ap.add_argument("--run-timeout", type=int, default=600, help="limit per launch (s); past it the run fails")
    ap.add_argument("--from-json", type=Path, help="only write the .md, .png and .summary.json of a run's record")
    ap.add_argument("--interleave", action="store_true",
                    help="the paro variants of a scenario in one launch, their steps in turns (auto first: its probe "
                         "plans them all); no peak memory figures")  # fmt: skip
    args = ap.parse_args(argv)
    args.scenario_list = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for s in args.scenario_list:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}")
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    skip = [p.strip() for p in args.skip.split(",") if p.strip()]
    for p in only + skip:
        if not any(fnmatch.fnmatchcase(v, p) for v in VARIANTS):
            ap.error(f"{p!r} matches no variant; variants: {', '.join(VARIANTS)}")
    args.variant_list = [
        v
        for v in VARIANTS
        if any(fnmatch.fnmatchcase(v, p) for p in only) and not any(fnmatch.fnmatchcase(v, p) for p in skip)
    ]
    if min(args.nodes, args.per_node, args.repeats, args.steps, args.grad_accum, args.micro_batch) < 1:
        ap.error("--nodes, --per-node, --repeats, --steps, --grad-accum and --micro-batch must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Sets up the testbed, calibrates, runs every (scenario, repeat, variant), writes JSON, markdown and plots."""
    args = parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        args.out_dir.mkdir(parents=True, exist_ok=True)
        write_reports(result, args.out_dir / args.from_json.name.removesuffix(".json"), args.from_json)
        return 0
    if not args.no_testbed and not require_root("training.py"):
        return 2
    exit_on_sigterm()  # so that the finally clauses (teardown, stopping torchruns) run
    k, m = args.nodes, args.per_node
    tag = f"{k}x{m}-{'localhost' if args.no_testbed else args.rate}" + (f"-{args.suffix}" if args.suffix else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / f"training-{tag}"
    logdir = args.out_dir / "raw" / f"training-{tag}"  # worker configs, the calibration, per-node logs
    raw = ext(logdir, ".json")  # the record (git-ignored, as raw/ is)
    logdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "machine": machine_info(("transformers", "deepspeed", "peft")),
        "link": link_info(k, args.rate, args.no_testbed),
        "config": {
            **{key: v for key, v in worker_config(args).items() if key not in ("nodes", "per_node")},
            "nodes": k,
            "per_node": m,
            "world": k * m,
            "scenarios": args.scenario_list,
            "variants": args.variant_list,
            "repeats": args.repeats,
            "interleave": args.interleave,
            "command": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])],
        },
        "runs": [],
    }
    total = len(args.scenario_list) * args.repeats * len(args.variant_list)
    t_start = time.time()
    done = 0

    def stamp() -> str:
        return f"[{time.time() - t_start:7.1f}s]"

    try:
        with tempfile.TemporaryDirectory() if args.no_testbed else Testbed(k, args.rate):
            launch_no = 0
            if any(VARIANTS[v].system == "paro" for v in args.variant_list):
                print(f"{stamp()} calibrating the links (paro_torch.calibrate)", flush=True)
                result["calibration"] = run_calibration(args, args.port, logdir)
                launch_no += 1
                print(f"{stamp()} calibration: {result['calibration']}", flush=True)
            paro = [v for v in args.variant_list if VARIANTS[v].system == "paro"] if args.interleave else []
            launches = ([paro] if paro else []) + [[v] for v in args.variant_list if v not in paro]
            for scenario in args.scenario_list:
                for rep in range(args.repeats):
                    for names in launches:
                        done += len(names)
                        port = args.port + launch_no % 1000
                        launch_no += 1
                        calibration = result.get("calibration", {})
                        runs = (
                            run_interleaved(args, scenario, names, rep, calibration, port, logdir)
                            if names is paro
                            else [run_variant(args, scenario, VARIANTS[names[0]], rep, calibration, port, logdir)]
                        )
                        result["runs"] += runs
                        walls = [r["wall_s"] for r in result["runs"]]
                        eta = (total - done) * sum(walls) / len(walls) / 60
                        for run in runs:
                            print(f"{stamp()} {done}/{total} {scenario} r{rep + 1} {run['variant']}: {describe(run)}"
                                  + (f"; about {eta:.0f} min to go" if done < total else ""), flush=True)  # fmt: skip
                        raw.write_text(json.dumps(result, indent=1) + "\n")  # progress, if stopped
    finally:
        result["machine"]["loadavg_at_end"] = os.getloadavg()
        result["machine"]["wall_s"] = round(time.time() - t_start, 1)
        if result["runs"]:
            raw.write_text(json.dumps(result, indent=1) + "\n")
    write_reports(result, base, raw)
    return 0


def describe(run: dict[str, Any]) -> str:
    """One progress line for a finished run."""
    if not run["ok"]:
        return f"FAILED ({run['wall_s']:.0f}s): {run['reason'][:200]}"
    inter = inter_bytes_per_step(run)
    s = f"{run['step_ms_median'] / 1e3:.3f} s/step, loss {run['loss']:.5f}"
    if inter is not None:
        s += f", inter {inter / 1e6:.2f} MB/step"
    ex = run.get("extra") or {}
    if "predicted" in ex:
        s += f", {ex['strategy']} predicted comm {ex['predicted']['time_s']:.4f} s"
    return s + f" ({run['wall_s']:.0f}s)"


if __name__ == "__main__":
    sys.exit(main())
