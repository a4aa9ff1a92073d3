"""Collective benchmark on an emulated multi-node cluster: Gloo vs paro (pipelined) vs paro (levels sequential).

Sets up the testbed (benchmarks/testbed.sh: one network namespace per node, tbf-shaped veth links through a bridge),
launches one torchrun per node inside its namespace for each backend variant, and collects from the workers
(benchmarks/_collective_worker.py) the median time per op and the bytes that crossed the inter-node links, read
from /proc/net/dev inside every node. Writes the table and plot to
benchmarks/results/collectives-<K>x<M>-<rate>.{md,png} and the record (config, machine, every rank's times and
counters) to benchmarks/results/raw/collectives-<K>x<M>-<rate>.json (git-ignored).

    sudo python3 benchmarks/collectives.py --nodes 2 --per-node 2 --sizes 1MiB,4MiB --repeats 3 --rate 1gbit
    python3 benchmarks/collectives.py --no-testbed --nodes 2 --per-node 2 --sizes 1MiB   # localhost, no root

``--no-testbed`` (alias ``--dry-run``) runs one torchrun with K*M ranks on plain localhost: everything works but no
link is shaped and the inter-node wire bytes cannot be told apart (only paro's own counters are reported).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _testbed import (
    HERE,
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

WORKER = HERE / "_collective_worker.py"
OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
SHORT_OP = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
}


@dataclass(frozen=True)
class Variant:
    """A backend configuration: the torch.distributed backend and the environment it runs with."""

    name: str
    backend: str
    env: dict[str, str] = field(default_factory=dict)
    about: str = ""


VARIANTS = {
    "gloo": Variant("gloo", "gloo", about="torch.distributed Gloo, flat"),
    "paro": Variant("paro", "paro", about="paro, pipelined (default PARO_CHUNK_BYTES / PARO_MAX_CHUNKS)"),
    "paro-seq": Variant("paro-seq", "paro", {"PARO_MAX_CHUNKS": "1"}, "paro, PARO_MAX_CHUNKS=1: levels sequential"),
}

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """'4MiB' -> 4194304; also KiB, GiB, kB, MB, GB and plain bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 512KiB, 4MiB, 1GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_size(n: int) -> str:
    """4194304 -> '4MiB'."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"


def _echo(rec: dict[str, Any]) -> None:
    """Progress: one line per finished case."""
    if rec["kind"] == "case":
        print(
            f"  {rec['variant']:9s} {SHORT_OP[rec['op']]:14s} {fmt_size(rec['size']):>7s}  {rec['median_ms']:9.2f} ms",
            flush=True,
        )


def launch(args: argparse.Namespace, variant: Variant, sizes: list[int], port: int, logdir: Path) -> list[dict]:
    """Runs every op and size of one variant in one launch; returns the worker's records."""
    k, m = args.nodes, args.per_node
    cfg = {
        "variant": variant.name,
        "backend": variant.backend,
        "ops": args.ops,
        "sizes": sizes,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "timeout_s": args.timeout,
        "iface": None,
    }
    logdir.mkdir(parents=True, exist_ok=True)
    cfg_path = logdir / f"{variant.name}.config.json"
    cfg_path.write_text(json.dumps(cfg))
    script = [str(WORKER), "--bench-config", str(cfg_path)]
    cmds = torchrun_commands(k, m, script, base_env(m, variant.env), port, args.no_testbed)
    return run_launch(variant.name, cmds, logdir, args.launch_timeout, _echo)


def summarize(records: list[dict[str, Any]], testbed: bool) -> list[dict[str, Any]]:
    """One row per (variant, op, size) with time and bytes per op (barrier traffic subtracted)."""
    overhead = {}
    for r in records:
        if r["kind"] == "overhead":
            overhead[(r["round"], r["variant"])] = {n["node"]: n["delta"] for n in r["nodes"]}
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in records:
        if r["kind"] == "case":
            groups.setdefault((r["variant"], r["op"], r["size"]), []).append(r)
    rows = []
    for (variant, op, size), recs in groups.items():
        row: dict[str, Any] = {
            "variant": variant,
            "op": op,
            "size": size,
            "rounds": len(recs),
            "median_ms": statistics.median(r["median_ms"] for r in recs),
            "median_ms_rounds": [r["median_ms"] for r in recs],
        }
        first = recs[0]
        reps = first["repeats"]
        ov = overhead.get((first["round"], variant), {})
        if testbed:
            iface = {n["node"]: f"veth-n{n['node']}" for n in first["nodes"]}
            raw_tx = sum(n["delta"][iface[n["node"]]]["tx"] for n in first["nodes"])
            raw_rx = sum(n["delta"][iface[n["node"]]]["rx"] for n in first["nodes"])
            ov_tx = sum(d[iface[n]]["tx"] for n, d in ov.items() if n in iface)
            row["inter_bytes_per_op"] = (raw_tx - ov_tx) / reps
            row["inter_bytes_per_op_raw"] = raw_tx / reps
            row["inter_rx_bytes_per_op_raw"] = raw_rx / reps
            row["barrier_tx_bytes_per_op"] = ov_tx / reps
            lo_tx = sum(n["delta"]["lo"]["tx"] for n in first["nodes"]) - sum(d["lo"]["tx"] for d in ov.values())
            row["intra_lo_bytes_per_op"] = lo_tx / reps
        else:
            row["inter_bytes_per_op"] = None
            lo_tx = sum(n["delta"]["lo"]["tx"] for n in first["nodes"]) - sum(d["lo"]["tx"] for d in ov.values())
            row["all_lo_bytes_per_op"] = lo_tx / reps
        if first["paro_inter_bytes"] is not None:
            row["paro_counted_inter_bytes_per_op"] = first["paro_inter_bytes"] / reps
            row["paro_counted_intra_bytes_per_op"] = first["paro_intra_bytes"] / reps
        rows.append(row)
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows.sort(key=lambda r: (OPS.index(r["op"]), r["size"], order.get(r["variant"], 99)))
    by_key = {(r["variant"], r["op"], r["size"]): r for r in rows}
    for r in rows:
        g = by_key.get(("gloo", r["op"], r["size"]))
        if r["variant"] != "gloo" and g:
            r["time_vs_gloo"] = r["median_ms"] / g["median_ms"]
            if r.get("inter_bytes_per_op") and g.get("inter_bytes_per_op"):
                r["inter_bytes_vs_gloo"] = r["inter_bytes_per_op"] / g["inter_bytes_per_op"]
        seq = by_key.get(("paro-seq", r["op"], r["size"]))
        if r["variant"] == "paro" and seq:
            r["pipelining_gain"] = seq["median_ms"] / r["median_ms"]
    return rows


def _b(x: float | None, size: int, missing: str = "n/a") -> str:
    return missing if x is None else f"{x / 2**20:.3f} MiB ({x / size:.2f} S)"


def _r(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def markdown(result: dict[str, Any]) -> str:
    """The human-readable report: settings, then one table row per (op, size, variant)."""
    mi, cf = result["machine"], result["config"]
    lines = [
        f"# Collectives, {cf['nodes']} nodes x {cf['per_node']} ranks, {result['link']['description']}",
        "",
        f"- machine: {mi['nproc']} cores ({mi['cpu']}), kernel {mi['kernel']}, load average at start "
        f"{', '.join(f'{x:.2f}' for x in mi['loadavg_at_start'])}; torch {mi['torch']}, paro-torch {mi['paro_torch']} "
        f"(commit {mi['git_commit'][:10]}{', dirty' if mi['git_dirty'] else ''}); {mi['time']}",
        f"- fp32; {cf['warmup']} warm-up + {cf['repeats']} timed repeats per case (barrier before each), "
        f"{cf['rounds']} round(s) interleaving the variants; time = max over ranks of each rank's median",
        "- inter-node bytes/op: sum over nodes of the node veth's tx bytes (from /proc/net/dev, headers and ACKs "
        "included) during the timed repeats, minus the same barriers run without a collective, / repeats; "
        "S = size of the collective",
        "- paro counted: inter-level bytes sent by all ranks per op, as paro_torch.comm_stats counts payload",
        "- variants: " + "; ".join(f"`{v['name']}` = {v['about']}" for v in result["variants"]),
        "",
        "| op | size | variant | median ms | inter-node bytes/op | paro counted inter/op | time vs gloo "
        "| inter bytes vs gloo | pipelining gain (seq/pipelined) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {SHORT_OP[r['op']]} | {fmt_size(r['size'])} | {r['variant']} | {r['median_ms']:.2f} "
            f"| {_b(r.get('inter_bytes_per_op'), r['size'])} "
            f"| {_b(r.get('paro_counted_inter_bytes_per_op'), r['size'], '–')} "
            f"| {_r(r.get('time_vs_gloo'))} | {_r(r.get('inter_bytes_vs_gloo'))} | {_r(r.get('pipelining_gain'))} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> bool:
    """Time vs size (and inter-node bytes / S vs size) per op; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    rows, ops = result["rows"], result["config"]["ops"]
    has_bytes = any(r.get("inter_bytes_per_op") is not None for r in rows)
    nrow = 2 if has_bytes else 1
    fig, axes = plt.subplots(nrow, len(ops), figsize=(4.2 * len(ops), 3.4 * nrow), squeeze=False)
    for j, op in enumerate(ops):
        for v in VARIANTS:
            pts = sorted((r["size"], r) for r in rows if r["op"] == op and r["variant"] == v)
            if not pts:
                continue
            xs = [s / 2**20 for s, _ in pts]
            axes[0][j].plot(xs, [r["median_ms"] for _, r in pts], marker="o", label=v)
            if has_bytes:
                axes[1][j].plot(xs, [r["inter_bytes_per_op"] / s for s, r in pts], marker="o", label=v)
        sizes = sorted({r["size"] for r in rows if r["op"] == op})
        for i in range(nrow):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_xticks([s / 2**20 for s in sizes], [fmt_size(s) for s in sizes])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.grid(alpha=0.3)
        axes[0][j].set_title(SHORT_OP[op])
        axes[0][j].set_yscale("log")
        axes[0][j].yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        axes[0][j].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axes[0][j].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes[0][j].set_ylabel("median ms (max over ranks)")
        axes[0][j].legend(fontsize=8)
        if has_bytes:
            axes[1][j].set_ylabel("inter-node bytes per op / S")
            axes[1][j].set_ylim(bottom=0)
        axes[nrow - 1][j].set_xlabel("size S")
    cf = result["config"]
    fig.suptitle(f"{cf['nodes']} nodes x {cf['per_node']} ranks, {result['link']['description']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="emulated nodes K (namespaces)")
    ap.add_argument("--per-node", type=int, default=2, help="ranks per node M (= PARO_GROUP_SIZE)")
    ap.add_argument("--sizes", default="1MiB,4MiB", help="total bytes S of each collective, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per case")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per case after one checked call")
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate of every link, both directions")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated, from: " + ", ".join(OPS))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=1, help="launch every variant this many times, interleaved")
    ap.add_argument("--no-testbed", "--dry-run", action="store_true", help="plain localhost, one torchrun, no root")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results", help="where the results go")
    ap.add_argument("--port", type=int, default=29511, help="first master port (testbed mode)")
    ap.add_argument("--timeout", type=int, default=300, help="process-group timeout (s)")
    ap.add_argument("--launch-timeout", type=int, default=900, help="limit per launch (s)")
    ap.add_argument("--from-json", type=Path, help="only write the .md and .png (in --out-dir) of a run's record")
    args = ap.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for o in args.ops:
        if o not in OPS:
            ap.error(f"unknown op {o!r}")
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}")
    if args.nodes < 1 or args.per_node < 1 or args.repeats < 1 or args.rounds < 1:
        ap.error("--nodes, --per-node, --repeats and --rounds must be at least 1")
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    """Sets up the testbed, runs every variant, writes JSON, markdown and a plot."""
    args = parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        args.out_dir.mkdir(parents=True, exist_ok=True)
        write_reports(result, args.out_dir / args.from_json.name.removesuffix(".json"))
        return 0
    k, m = args.nodes, args.per_node
    world = k * m
    unit = 4 * world  # fp32 and an equal block per rank
    sizes = []
    for s in args.size_list:
        if s % unit:
            print(f"size {s} is not a multiple of 4 x {world} ranks: using {s - s % unit}", file=sys.stderr)
            s -= s % unit
        if s <= 0:
            print(f"size too small for {world} ranks", file=sys.stderr)
            return 2
        sizes.append(s)
    if not args.no_testbed and not require_root("collectives.py"):
        return 2
    exit_on_sigterm()  # so that the finally clauses (teardown, stopping torchruns) run

    tag = f"{k}x{m}-{'localhost' if args.no_testbed else args.rate}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    logdir = args.out_dir / "raw" / f"collectives-{tag}"
    link = link_info(k, args.rate, args.no_testbed)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "link": link,
        "config": {
            "nodes": k,
            "per_node": m,
            "world": world,
            "sizes": sizes,
            "ops": args.ops,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "dtype": "float32",
            "command": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])],
        },
        "variants": [
            {"name": v, "backend": VARIANTS[v].backend, "env": VARIANTS[v].env, "about": VARIANTS[v].about}
            for v in args.variants
        ],
    }
    records: list[dict[str, Any]] = []
    t_start = time.time()
    with tempfile.TemporaryDirectory() if args.no_testbed else Testbed(k, args.rate):
        launch_no = 0
        for rnd in range(args.rounds):
            for name in args.variants:
                print(f"[{time.time() - t_start:6.1f}s] round {rnd + 1}/{args.rounds}: {name}", flush=True)
                recs = launch(args, VARIANTS[name], sizes, args.port + 10 * launch_no, logdir)
                launch_no += 1
                for r in recs:
                    r["round"] = rnd
                records.extend(recs)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["machine"]["wall_s"] = round(time.time() - t_start, 1)
    result["rows"] = summarize(records, not args.no_testbed)
    result["records"] = records
    base = args.out_dir / f"collectives-{tag}"
    raw = args.out_dir / "raw" / f"collectives-{tag}.json"  # the record: every rank's figures (git-ignored)
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {raw} ({result['machine']['wall_s']} s)")
    write_reports(result, base)
    return 0


_ext = ext  # (the name this module used before the helpers moved to _testbed.py)


def write_reports(result: dict[str, Any], base: Path) -> None:
    """Writes <base>.md and <base>.png from a result and prints the table."""
    md = markdown(result)
    _ext(base, ".md").write_text(md)
    print(f"wrote {_ext(base, '.md')}")
    if plot(result, _ext(base, ".png")):
        print(f"wrote {_ext(base, '.png')}")
    print("\n" + md)


if __name__ == "__main__":
    sys.exit(main())
