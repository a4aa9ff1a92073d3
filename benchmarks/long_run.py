"""The main job for many steps: host memory, open file descriptors and threads of every rank
over time, and the loss at every step. They must stay flat after warm-up and the loss finite throughout.

    python3 benchmarks/long_run.py --steps 2000          # about 9 minutes on 2 cores (b99d685); no root, no testbed

Runs ``examples/train.py --strategy auto`` under torchrun (4 ranks as 2 groups of 2, as scripts/main.sh does),
samples ``/proc/<pid>`` of each rank every ``--every`` seconds, and writes ``benchmarks/results/long-run.md`` (the curve
at about 20 points and the verdict) and the record ``benchmarks/results/raw/long-run.json`` (every sample, every loss,
machine facts with the commit; git-ignored).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _testbed import REPO, machine_info

STEP_LINE = re.compile(r"step\s+(\d+)\s+loss\s+(\S+)")
WARMUP = 0.1  # the first 10 % of the run is warm-up (allocator pools, lazily created groups)


def rank_pids(launcher: int) -> dict[int, int]:
    """RANK -> pid of the workers that torchrun (pid ``launcher``) started."""
    pids: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher:
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                pids[rank] = int(proc.name)
    return pids


def sample(pid: int) -> dict[str, int] | None:
    """Resident memory (bytes), open file descriptors and threads of one process; None once it has ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "fds": fds, "threads": int(fields["Threads"])}


def run(steps: int, every: float) -> dict[str, Any]:
    env = dict(os.environ, PARO_GROUP_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(REPO / "examples" / "train.py"), "--strategy", "auto", "--steps", str(steps),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    losses: dict[int, float] = {}
    tail: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail[:] = (tail + [line])[-50:]
            if m := STEP_LINE.search(line):
                losses[int(m.group(1))] = float(m.group(2))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    while proc.poll() is None:
        time.sleep(every)
        pids = rank_pids(proc.pid)
        per_rank = {r: s for r, pid in sorted(pids.items()) if (s := sample(pid)) is not None}
        if len(per_rank) == 4 and losses:
            samples.append({"t": time.monotonic() - start, "step": max(losses), "ranks": per_rank})
    reader.join(timeout=10)
    if proc.returncode != 0:
        raise SystemExit(f"the job failed ({proc.returncode}):\n{''.join(tail)}")
    return {"steps": steps, "losses": [losses.get(s) for s in range(steps)], "samples": samples}


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """Growth of each quantity (the most over ranks) from the end of warm-up to the end of the run."""
    samples = result["samples"]
    after = [s for s in samples if s["step"] >= WARMUP * result["steps"]]
    first, last = after[0], after[-1]

    def growth(key: str) -> int:
        return max(last["ranks"][r][key] - first["ranks"][r][key] for r in first["ranks"])

    losses = result["losses"]
    return {
        "rss_growth_bytes": growth("rss"),
        "rss_after_warmup_bytes": max(s["rss"] for s in first["ranks"].values()),
        "fd_growth": growth("fds"),
        "thread_growth": growth("threads"),
        "missing_losses": sum(v is None for v in losses),
        "nonfinite_losses": sum(v is not None and not math.isfinite(v) for v in losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def table(result: dict[str, Any], v: dict[str, Any], machine: dict[str, Any]) -> str:
    samples = result["samples"]
    picks = [samples[round(i * (len(samples) - 1) / 19)] for i in range(20)] if len(samples) >= 20 else samples
    mb = 1 << 20
    lines = [
        f"# Long run: examples/train.py --strategy auto, {result['steps']} steps, 4 ranks as 2 groups x 2",
        "",
        f"Measured at commit {machine['git_commit'][:7]}{' (dirty)' if machine['git_dirty'] else ''}, "
        f"{machine['time']}, torch {machine['torch']}, {machine['nproc']} cores. Every rank's resident memory, "
        "open file descriptors and threads, sampled from /proc; the loss is rank 0's mean over ranks at that step.",
        "",
        "| time (s) | step | loss | RSS per rank (MiB) | fds per rank | threads per rank |",
        "|---:|---:|---:|---|---|---|",
    ]
    for s in picks:
        ranks = [s["ranks"][r] for r in sorted(s["ranks"])]
        loss = result["losses"][s["step"]]
        lines.append(
            f"| {s['t']:.0f} | {s['step']} | {loss:.4f} | {' / '.join(str(round(x['rss'] / mb)) for x in ranks)} | "
            f"{' / '.join(str(x['fds']) for x in ranks)} | {' / '.join(str(x['threads']) for x in ranks)} |"
        )
    lines += [
        "",
        f"After warm-up (step {int(WARMUP * result['steps'])}) to the end, the most any rank grew: resident memory "
        f"{v['rss_growth_bytes'] / mb:+.1f} MiB (of {v['rss_after_warmup_bytes'] / mb:.0f} MiB), file descriptors "
        f"{v['fd_growth']:+d}, threads {v['thread_growth']:+d}. Losses: {v['nonfinite_losses']} not finite, "
        f"{v['missing_losses']} missing; {v['first_loss']:.4f} at the first step, {v['last_loss']:.4f} at the last.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "long-run",
                        help="OUT.md; the record goes to raw/ beside it")  # fmt: skip
    args = parser.parse_args()
    machine = machine_info()
    result = run(args.steps, args.every)
    v = verdict(result)
    raw = args.out.parent / "raw" / (args.out.name + ".json")
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps({"machine": machine, "verdict": v, **result}, indent=1))
    text = table(result, v, machine)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
