"""Runs multi-rank workers many times in a row and counts the runs in which any rank exited non-zero (issue #14).

    python scripts/clean_exits.py --runs 50            # every case below, 50 runs each
    python scripts/clean_exits.py --runs 10 --only fsdp2,no_destroy

Each case is a worker of tests/workers on 4 ranks as 2 groups of 2 (the ``paro`` backend). Prints one table row
per case: runs, failed runs, the exit codes seen, seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from launch import launch  # noqa: E402

CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "ddp": ("frameworks.py", ("ddp",)),
    "fsdp1_full": ("frameworks.py", ("fsdp1_full",)),
    "fsdp1_hybrid": ("frameworks.py", ("fsdp1_hybrid",)),
    "fsdp2": ("frameworks.py", ("fsdp2",)),
    "hsdp": ("frameworks.py", ("hsdp",)),
    "no_destroy": ("no_destroy.py", ()),
    "deepspeed_zero3": ("deepspeed_zero3.py", ()),
}


def main() -> None:
    """Runs the chosen cases and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    print("| case | runs | failed runs | exit codes (rank x runs) | seconds |")
    print("|---|---|---|---|---|")
    for name in names:
        script, wargs = CASES[name]
        if script == "deepspeed_zero3.py" and importlib.util.find_spec("deepspeed") is None:
            print(f"| {name} | skipped: deepspeed is not installed | | | |")
            continue
        codes: Counter[int] = Counter()
        failed, start = 0, time.monotonic()
        for _ in range(args.runs):
            results = launch(script, 4, env={"PARO_GROUP_SIZE": "2"}, args=wargs, timeout=300)
            codes.update(r.returncode for r in results)
            failed += any(r.returncode != 0 for r in results)
        seen = ", ".join(f"{c}: {k}" for c, k in sorted(codes.items()))
        print(f"| {name} | {args.runs} | {failed} | {seen} | {time.monotonic() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
