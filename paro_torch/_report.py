"""The cost model's report as a table: one row per strategy, then the choice and its reason."""

from __future__ import annotations

from typing import Any


def format_report(report: dict[str, Any]) -> str:
    """The report as a table, one row per strategy, then the choice and the notes."""
    model = report["model"]
    lines = [
        f"model: {_scaled(model['params'], '')} parameters, {_scaled(model['trainable'], '')} trainable, "
        f"in {_plural(model['blocks'], 'block')}",
        f"cluster: {report['world']} ranks = {report['groups']} groups x {report['group_size']}, "
        f"{_scaled(report['memory_budget'], 'B')} per rank, {report['collectives']} collectives, "
        f"{_plural(report['grad_accum'], 'micro-step')} per step",
        "",
    ]
    header = ("strategy", "known as", "memory/rank", "intra/step", "inter/step", "comm", "step", "compute",
              "exposed", "interference", "optimizer", "fits")  # fmt: skip
    rows = [
        (
            s["code"],
            s["known_as"] or "",
            _scaled(s["memory"]["total"], "B"),
            _scaled(s["intra_bytes"], "B"),
            _scaled(s["inter_bytes"], "B"),
            _seconds(s["time_s"]),
            _seconds(s["step"]["step_s"]),
            _seconds(s["step"]["compute_s"]),
            _seconds(_exposed(s["step"])),
            _seconds(s["step"].get("interference_s", 0.0)),
            _seconds(s["step"]["optimizer_s"]),
            "yes" if s["fits"] else "no",
        )
        for s in report["strategies"]
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        cells = [cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    lines.append(
        "comm: all collectives of a step one after another; step: predicted step time = compute + exposed "
        "communication (what compute waits for) + interference (what collectives beside compute cost it) + optimizer"
    )
    lines.append(f"auto: {report['reason']}")
    lines.extend(f"note: {note}" for note in report["notes"])
    return "\n".join(lines)


def _exposed(step: dict[str, float]) -> float:
    """Communication compute waits for, all levels."""
    return step["exposed_intra_s"] + step["exposed_inter_s"] + step["exposed_global_s"]


def _scaled(value: float, unit: str) -> str:
    """``44.8 GB``, ``1.36 MB``, ``512 B`` (decimal prefixes; for counts, ``65.2B``)."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            if not unit:  # a count: 65.2B parameters
                prefix = {"G": "B"}.get(prefix, prefix)
            return f"{value / factor:.3g}{' ' if unit else ''}{prefix}{unit}"
    return f"{value:.0f}{' ' if unit else ''}{unit}"


def _plural(count: int, noun: str) -> str:
    """``1 block``, ``2 blocks``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _seconds(t: float) -> str:
    """Seconds with a unit that keeps about three significant digits."""
    if t == 0:
        return "0"
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.1f} µs"
