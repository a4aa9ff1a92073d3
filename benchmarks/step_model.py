"""The cost model's predicted step time against measured, over training benchmark runs.

Reads the JSON files that ``benchmarks/training.py`` wrote (one per cluster shape and link rate, every paro
strategy and ``auto`` in each scenario): the records in ``results/raw/`` or the ``.summary.json`` files beside the
tables (the same report from either), and prints one markdown report: per shape and scenario, how many strategies
the model predicted within 20 % of their measured step time, its median error, and whether ``auto``'s pick ran within
5 % of the fastest measured strategy; then every cell.

    python3 benchmarks/step_model.py benchmarks/results/training-2x2-1gbit-ilv8.summary.json ... \\
        --out benchmarks/results/step-model-ilv8.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from training import AUTO_SLACK, STEP_PARTS, TOLERANCE, prediction, summarize


def shape_name(result: dict[str, Any]) -> str:
    cf = result["config"]
    return f"{cf['nodes']} x {cf['per_node']}, {result['link'].get('rate', 'localhost')}"


def report(results: list[dict[str, Any]]) -> str:
    """The markdown report over ``results`` (the parsed JSON files)."""
    commits = sorted({r["machine"]["git_commit"][:10] + (" (dirty)" if r["machine"]["git_dirty"] else "")
                      for r in results})  # fmt: skip
    lines = [
        "# The step model against measured step times",
        "",
        f"Commit {', '.join(commits)}; {results[0]['machine']['nproc']} cores; each cell the median over "
        f"{' / '.join(sorted({str(r['config']['repeats']) for r in results}))} launch(es) of the median over its "
        "measured steps, predicted likewise (each launch measures its own compute throughput"
        + (
            "; interleaved: one launch per scenario for all its paro cells, one probe, steps in turns"
            if any(r["config"].get("interleave") for r in results)
            else ""
        )
        + "). Error = predicted / measured - 1.",
        "",
        f"| shape | scenario | strategies | within {TOLERANCE:.0%} | median error | worst error | Spearman ρ "
        f"| fastest measured | auto picked | pick / fastest (target ≤ {1 + AUTO_SLACK:.2f}) "
        "| auto's own run / fastest |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    # from the runs, not the files' own "predictions": older files read as the current analysis reads them; a
    # summary file (training.py's .summary.json) has no runs, only their summary
    analyses = [
        {s: prediction(rows) for s, rows in (summarize(result) if "runs" in result else result["summary"]).items()}
        for result in results
    ]
    cells = within = 0
    for result, analysis in zip(results, analyses, strict=True):
        for scenario, pc in analysis.items():
            if not pc.get("n"):
                continue
            errors = [t["error"] for t in pc["table"]]
            cells += len(errors)
            within += pc["within_tolerance"]
            worst = max(errors, key=abs)
            ratio = pc.get("auto_pick_vs_fastest")
            own = pc["auto_step_s"] / pc["fastest_measured_step_s"] if "auto_step_s" in pc else None
            lines.append(
                f"| {shape_name(result)} | {scenario} | {pc['n']} | {pc['within_tolerance']} "
                f"| {statistics.median(errors):+.0%} | {worst:+.0%} | {_f(pc.get('spearman_time'), '{:.2f}')} "
                f"| {pc['fastest_measured']} | {', '.join(sorted(set(pc.get('auto_choices') or ['–'])))} "
                f"| {_f(ratio, '{:.3f}')} "
                f"| {_f(own, '{:.3f}')} |"
            )
    lines += ["", f"In all: {within} of {cells} cells within {TOLERANCE:.0%} ({within / max(cells, 1):.0%})."]
    for result, analysis in zip(results, analyses, strict=True):
        for scenario, pc in analysis.items():
            if not pc.get("n"):
                continue
            lines += [
                "",
                f"## {shape_name(result)}, {scenario}",
                "",
                "| strategy | predicted s | compute | exposed intra | exposed inter | exposed global | interference "
                "| optimizer | measured s | error |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for t in sorted(pc["table"], key=lambda t: t["step_s"]):
                st = t.get("predicted_step") or {}
                parts = " | ".join(_f(st.get(k), "{:.3f}") for k in STEP_PARTS)
                lines.append(
                    f"| {t['strategy']} | {t['predicted_step_s']:.3f} | {parts} | {t['step_s']:.3f} "
                    f"| {t['error']:+.0%} |"
                )
            lines += _comm_seconds_table(pc["table"])
    return "\n".join(lines) + "\n"


def _comm_seconds_table(table: list[dict[str, Any]]) -> list[str]:
    """Seconds per step the engine's communication threads spent in each collective and level, where recorded."""
    kinds = sorted({k for t in table for k in (t.get("comm_seconds") or {})}, key=lambda k: (k.split()[1], k))
    if not kinds:
        return []
    lines = [
        "",
        "Measured: seconds per step in each collective on the engine's communication threads (from call to return, "
        "waits for late peers included; mean over ranks), and in the copy-outs after gathers (unpack local):",
        "",
        "| strategy | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
    ]
    for t in sorted(table, key=lambda t: t["step_s"]):
        busy = t.get("comm_seconds") or {}
        lines.append(f"| {t['strategy']} | " + " | ".join(_f(busy.get(k), "{:.3f}") for k in kinds) + " |")
    return lines


def _f(x: float | None, fmt: str) -> str:
    return "–" if x is None else fmt.format(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="JSON files of benchmarks/training.py (records or summaries)")
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()
    text = report([json.loads(p.read_text()) for p in args.results])
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
