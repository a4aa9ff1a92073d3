"""The GPU check: one call on the GPU machine (``scripts/gpu_check.sh OUT_DIR``), or its CPU subset (``--dry-run``).

Writes OUT_DIR/log.txt (the environment, every stage's command, environment and rank outputs, the timing table) and
OUT_DIR/summary.json (one entry per stage: name, passed, seconds, skipped reason, per-check results, the last lines of
output on failure), both rewritten as it goes so that a run cut short still leaves them. Each stage has its own
timeout, capped by what is left of the whole run's budget, so one hang cannot eat the rest. Needs torch and the
checkout (with paro's extension carried for the paro stages); no network, no Rust.

Stages, each launching WORLD ranks on cuda:0 (on the CPU in a dry run):
  environment        GPU, driver, torch, CUDA, NCCL, Python, MPS
  kit                paro_torch and its extension import; in a dry run also the size of what travels
  gloo               tests/gpu/collectives_check.py on Gloo (CUDA tensors on the GPU)
  nccl               the same on NCCL, several ranks on one GPU (GPU only)
  paro               the same on init_process_group("paro"), PARO_GROUP_SIZE=2
  EXTRA_STAGES       the CPU suite's workers on CUDA: paro's collectives (NCCL, Gloo sub-groups), engine parity
  paro chunk timing  tests/gpu/chunk_timing.py with PARO_MAX_CHUNKS=1 and with the default, side by side
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from kit import CARRY, LIMIT, travel_bytes  # noqa: E402

WORLD = 4
CHECK_LINE = re.compile(r"^CHECK (.*?): (ok|FAIL.*|skipped: .*)$")


@dataclass
class Worker:
    """One stage that launches ``script`` on WORLD ranks (``{device}`` in ``args`` becomes cuda or cpu)."""

    name: str
    script: str
    backend: str
    args: tuple[str, ...] = ("--device", "{device}")
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 90
    gpu_only: bool = False


# The engine's parity test on CUDA and other checks to come: one line per stage. A worker gets --backend <backend>
# and ``args``; it prints ``CHECK <name>: ok | FAIL <reason> | skipped: <reason>`` lines and exits 0 when all passed.
def suite(name: str, backend: str, worker: str, *args: str, env: dict[str, str], **kw: object) -> Worker:
    """A stage running a worker of the CPU suite (tests/workers) on the stage's device (tests/gpu/suite_worker.py)."""
    argv = ("--device", "{device}", worker, *args)
    return Worker(name, "tests/gpu/suite_worker.py", backend, args=argv, env=env, **kw)  # type: ignore[arg-type]


EXTRA_STAGES: list[Worker] = [
    # every collective, dtype and size of the paro backend (its CPU test) on CUDA tensors, NCCL sub-groups
    suite("paro suite", "paro", "collectives.py", env={"PARO_GROUP_SIZE": "2", "PARO_CHUNK_BYTES": "256"}, timeout=120),
    # the same on Gloo sub-groups for CUDA tensors (streams and events without NCCL)
    suite(
        "paro suite, gloo sub-groups",
        "paro",
        "collectives.py",
        env={"PARO_GROUP_SIZE": "2", "PARO_CHUNK_BYTES": "256", "PARO_DEVICE_SUB_BACKEND": "gloo"},
        timeout=120,
        gpu_only=True,
    ),
    # ParoShardedModule against single-process training, the engine's groups on NCCL (cpu:gloo,cuda:nccl)
    suite(
        "engine parity",
        "nccl",
        "engine.py",
        "plain",
        "NNN",
        "NNG",
        "IIG",
        "GGG",
        env={"PARO_GROUP_SIZE": "2"},
        timeout=150,
    ),
    # a prefetching GGG engine holds about two units at a time (allocator peak on CUDA)
    Worker("engine memory", "tests/gpu/engine_memory.py", "nccl", timeout=90),
]


def collectives(backend: str, **kw: object) -> Worker:
    env = {"PARO_GROUP_SIZE": "2"} if backend == "paro" else {}
    return Worker(backend, "tests/gpu/collectives_check.py", backend, env=env, **kw)  # type: ignore[arg-type]


class Run:
    """The log, the summary and the time budget of one check run."""

    def __init__(self, out: Path, dry_run: bool, budget: float) -> None:
        self.out = out
        self.dry_run = dry_run
        self.deadline = time.monotonic() + budget
        self.budget = budget
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "log.txt", "w", encoding="utf-8")  # noqa: SIM115
        self.summary: dict[str, object] = {
            "mode": "dry run (CPU subset)" if dry_run else "GPU",
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": budget,
            "environment": {},
            "note": "passed: true/false per stage, null when skipped (see skipped); a stage passes when every rank "
            "exited 0 within its timeout and every check passed on every rank",
            "stages": [],
        }

    def log(self, text: str = "", echo: bool = False) -> None:
        self.log_file.write(text + "\n")
        self.log_file.flush()
        if echo:
            print(text, flush=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, entry: dict[str, object]) -> None:
        self.summary["stages"].append(entry)  # type: ignore[union-attr]
        stages = self.summary["stages"]
        self.summary["passed"] = all(s["passed"] is not False for s in stages)  # type: ignore[union-attr]
        self.summary["failed_stages"] = [s["name"] for s in stages if s["passed"] is False]  # type: ignore[union-attr]
        self.summary["skipped_stages"] = [s["name"] for s in stages if s["passed"] is None]  # type: ignore[union-attr]
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        status = (
            "skipped: " + str(entry["skipped"]) if entry.get("skipped") else ("PASS" if entry["passed"] else "FAIL")
        )
        timed_out = " after its timeout" if entry.get("status") == "timeout" else ""
        line = f"== stage {entry['name']}: {status}{timed_out} ({entry['seconds']:.1f} s)"
        if entry.get("checks"):
            c = entry["checks"]
            line += f"; checks ok {c['ok']}, failed {len(c['failed'])}, skipped {len(c['skipped'])}"  # type: ignore[index]
        self.log(line, echo=True)

    def skip(self, name: str, why: str) -> None:
        self.record({"name": name, "passed": None, "skipped": why, "seconds": 0.0})


def sh(cmd: list[str], timeout: float = 20) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except Exception as e:  # noqa: BLE001  (a missing tool is part of what the log reports)
        return f"({cmd[0]}: {type(e).__name__}: {e})"


def mps_state() -> str:
    """Whether CUDA MPS serves this machine: its daemon or server process, or a pipe directory."""
    procs = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:
            continue
        if name.startswith("nvidia-cuda-mps"):
            procs.append(name)
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    if procs:
        return f"on ({', '.join(sorted(set(procs)))} running)"
    if Path(pipe, "control").exists():
        return f"probably on (no MPS process visible, but {pipe}/control exists)"
    return "off (no nvidia-cuda-mps-control/-server process, no MPS pipe directory)"


def environment(run: Run) -> dict[str, object]:
    t0 = time.monotonic()
    import torch

    env: dict[str, object] = {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception as e:  # noqa: BLE001
        env["nccl"] = f"unknown ({e})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = p.name
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        env["gpu_capability"] = f"{p.major}.{p.minor}"
    env["nvidia_smi"] = sh(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_mode", "--format=csv,noheader"]
    )
    env["mps"] = mps_state()
    env["git"] = sh(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=12"])
    env["kit_extension"] = {c: (ROOT / c).stat().st_size if (ROOT / c).exists() else "missing" for c in CARRY}
    run.summary["environment"] = env
    run.log("== environment", echo=True)
    for k, v in env.items():
        run.log(f"  {k}: {v}", echo=True)
    run.log()
    entry: dict[str, object] = {"name": "environment", "passed": True, "seconds": round(time.monotonic() - t0, 1)}
    if not env["cuda_available"] and not run.dry_run:
        entry.update(passed=False, tail=["torch sees no GPU (not a dry run)"])
    run.record(entry)
    return env


def nccl_env(nccl: str) -> tuple[str, dict[str, str], bool]:
    """Several ranks on one GPU: NCCL >= 2.30 allows it with NCCL_MULTI_RANK_GPU_ENABLE=1; before, each rank poses as
    its own host (a distinct NCCL_HOSTID) and the ranks talk over sockets on the loopback. Returns (description, the
    common environment, whether each rank needs its own NCCL_HOSTID)."""
    try:
        version = tuple(int(v) for v in nccl.split(".")[:2])
    except ValueError:
        version = (0, 0)
    common = {"NCCL_DEBUG": "WARN"}
    if version >= (2, 30):
        common.update(NCCL_MULTI_RANK_GPU_ENABLE="1", NCCL_MAX_CTAS="8")
        return f"NCCL {nccl} >= 2.30: NCCL_MULTI_RANK_GPU_ENABLE=1", common, False
    common.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", NCCL_SOCKET_IFNAME="lo")
    return f"NCCL {nccl} < 2.30: a distinct NCCL_HOSTID per rank, sockets over lo", common, True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    run: Run, name: str, script: str, args: list[str], env: dict[str, str], per_rank_hostid: bool, timeout: float
) -> tuple[str, list[tuple[int | None, str]]]:
    """Starts WORLD ranks of ``script``; returns ("ok" | "failed" | "timeout", [(returncode, output)] per rank)."""
    port = free_port()
    procs = []
    with tempfile.TemporaryDirectory(prefix="paro-gpu-check-") as tmp:
        files = []
        for rank in range(WORLD):
            e = dict(os.environ)
            e.pop("LOCAL_WORLD_SIZE", None)
            e.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(WORLD),
                LOCAL_RANK=str(rank),
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
            )
            e.update(env)
            if per_rank_hostid:
                e["NCCL_HOSTID"] = f"paro-gpu-check-rank{rank}"
            f = open(Path(tmp) / f"rank{rank}.txt", "w+", encoding="utf-8")  # noqa: SIM115
            files.append(f)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(ROOT / script), *args],
                    cwd=ROOT,
                    env=e,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        end = time.monotonic() + timeout
        status = "ok"
        while any(p.poll() is None for p in procs):
            if time.monotonic() > end:
                status = "timeout"
                for p in procs:
                    if p.poll() is None:
                        try:
                            os.killpg(p.pid, 9)
                        except ProcessLookupError:
                            pass
                for p in procs:
                    p.wait()
                break
            time.sleep(0.2)
        outs = []
        for p, f in zip(procs, files, strict=True):
            f.flush()
            f.seek(0)
            outs.append((p.returncode, f.read()))
            f.close()
    if status == "ok" and any(rc != 0 for rc, _ in outs):
        status = "failed"
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    run.log(f"-- {name}: {shown} {sys.executable} {script} {' '.join(args)}  (x{WORLD} ranks, timeout {timeout:.0f} s)")
    for rank, (rc, out) in enumerate(outs):
        run.log(f"---- rank {rank} exit {rc}{' (killed: timeout)' if status == 'timeout' else ''}")
        run.log(out.rstrip())
    return status, outs


def parse_checks(outs: list[tuple[int | None, str]]) -> dict[str, object]:
    """Folds the ranks' CHECK lines: a check passed when every rank said ok."""
    per: dict[str, list[str]] = {}
    for _, out in outs:
        for line in out.splitlines():
            m = CHECK_LINE.match(line)
            if m:
                per.setdefault(m[1], []).append(m[2])
    passed, failed, skipped = [], [], []
    for name, results in per.items():
        bad = [r for r in results if r.startswith("FAIL")]
        if bad:
            failed.append(f"{name}: {bad[0]} ({len(bad)} of {len(results)} ranks)")
        elif all(r.startswith("skipped") for r in results):
            skipped.append(f"{name}: {results[0]}")
        elif len(results) < WORLD:
            failed.append(f"{name}: reported by {len(results)} of {WORLD} ranks only")
        else:
            passed.append(name)
    return {"ok": len(passed), "failed": failed, "skipped": skipped, "passed": passed}


def tail(outs: list[tuple[int | None, str]], lines: int = 25) -> list[str]:
    """The last lines of each rank that failed (of every rank after a timeout)."""
    got = []
    for rank, (rc, out) in enumerate(outs):
        if rc != 0:
            got.append(f"--- rank {rank} exit {rc}")
            got.extend(out.splitlines()[-lines:])
    return got


def worker_stage(run: Run, w: Worker, device: str, nccl: tuple[str, dict[str, str], bool] | None) -> None:
    left = run.left() - 10
    if left < 20:
        run.skip(w.name, f"out of time budget ({run.budget:.0f} s)")
        return
    env = dict(w.env)
    hostid = False
    if device == "cuda" and nccl is not None and w.backend in ("nccl", "paro"):
        env.update(nccl[1])  # paro's CUDA sub-groups are NCCL too
        hostid = nccl[2]
    args = ["--backend", w.backend, *(a.replace("{device}", device) for a in w.args)]
    t0 = time.monotonic()
    status, outs = launch(run, w.name, w.script, args, env, hostid, min(w.timeout, left))
    checks = parse_checks(outs)
    passed = status == "ok" and not checks["failed"]
    entry: dict[str, object] = {
        "name": w.name,
        "passed": passed,
        "seconds": round(time.monotonic() - t0, 1),
        "status": status,
        "command": f"{w.script} {' '.join(args)}",
        "env": env,
        "checks": checks,
    }
    if not passed:
        entry["tail"] = tail(outs)
    run.record(entry)


def timing_stage(run: Run, device: str, nccl: tuple[str, dict[str, str], bool] | None, paro_ok: bool) -> None:
    name = "paro chunk timing"
    if not paro_ok:
        run.skip(name, "paro_torch does not import")
        return
    t0 = time.monotonic()
    rows: dict[tuple[str, int], dict[str, float]] = {}
    statuses = []
    tails: list[str] = []
    for label, chunks in (("one chunk", {"PARO_MAX_CHUNKS": "1"}), ("pipelined", {})):
        left = run.left() - 10
        if left < 20:
            statuses.append("out of time budget")
            break
        env = {"PARO_GROUP_SIZE": "2", **chunks}
        hostid = False
        if device == "cuda" and nccl is not None:
            env.update(nccl[1])
            hostid = nccl[2]
        args = ["--backend", "paro", "--device", device]
        status, outs = launch(run, f"{name} ({label})", "tests/gpu/chunk_timing.py", args, env, hostid, min(60, left))
        statuses.append(status)
        if status != "ok":
            tails.extend(tail(outs))
        for line in outs[0][1].splitlines():
            if line.startswith("TIMING "):
                row = json.loads(line[7:])
                rows.setdefault((row["op"], row["mib"]), {})[label] = row["ms"]
    table = ["| collective | MiB | one chunk (ms) | pipelined (ms) | one chunk / pipelined |", "|---|---|---|---|---|"]
    for (op, mib), t in rows.items():
        a, b = t.get("one chunk"), t.get("pipelined")
        ratio = f"{a / b:.2f}" if a and b else "-"
        table.append(f"| {op} | {mib} | {a and f'{a:.2f}' or '-'} | {b and f'{b:.2f}' or '-'} | {ratio} |")
    run.log(f"== {name} on {device}, {WORLD} ranks, groups of 2 (mean of 5 after one warm-up; whole-tensor size)")
    for line in table:
        run.log(line, echo=True)
    passed = statuses == ["ok", "ok"] and bool(rows)
    entry: dict[str, object] = {
        "name": name,
        "passed": passed,
        "seconds": round(time.monotonic() - t0, 1),
        "status": statuses,
        "table": table,
    }
    if not passed:
        entry["tail"] = tails
    run.record(entry)


def kit_stage(run: Run) -> bool:
    """Imports paro_torch from the checkout; in a dry run, also checks the size of what travels. Returns whether
    paro_torch imports."""
    t0 = time.monotonic()
    code = (
        "import sys; sys.path.insert(0, '.'); import paro_torch, torch; "
        "print('paro_torch', paro_torch.__file__, 'extension', paro_torch._C.__file__, 'torch', torch.__version__); "
        "print('strategy IIG:', paro_torch.Strategy('IIG'))"
    )
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        out, imported = (r.stdout + r.stderr).strip(), r.returncode == 0
    except subprocess.TimeoutExpired:
        out, imported = "import timed out after 120 s", False
    run.log("-- kit: import paro_torch")
    run.log(out)
    entry: dict[str, object] = {"name": "kit", "imports": imported}
    notes = []
    ok = imported
    if run.dry_run:
        try:
            sizes = travel_bytes()
            entry["travel_bytes"] = sizes
            fits = sizes["total"] <= LIMIT and all((ROOT / c).exists() for c in CARRY)
            notes.append(f"travel {sizes['total']} bytes (limit {LIMIT}), carry {CARRY}")
            ok = ok and fits
        except Exception as e:  # noqa: BLE001
            notes.append(f"travel size unknown: {e}")
            ok = False
    for n in notes:
        run.log("  " + n)
    entry.update(passed=ok, seconds=round(time.monotonic() - t0, 1))
    if not ok:
        entry["tail"] = out.splitlines()[-25:] + notes
    run.record(entry)
    return imported


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder for log.txt and summary.json")
    p.add_argument("--dry-run", action="store_true", help="no GPU: the CPU subset of every stage")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default 390 on a GPU, 1200 dry)")
    a = p.parse_args()
    run = Run(a.out, a.dry_run, a.budget or (1200 if a.dry_run else 390))
    env = environment(run)
    gpu = bool(env["cuda_available"])
    if not gpu and not a.dry_run:
        run.log("no GPU visible: the CUDA stages are skipped; use --dry-run on a machine without one", echo=True)
    device = "cuda" if gpu and not a.dry_run else "cpu"
    no_gpu = "no GPU (dry run)" if a.dry_run else "no GPU"
    nccl = nccl_env(str(env["nccl"])) if device == "cuda" else None
    if nccl:
        run.log(f"multi-rank NCCL on one GPU: {nccl[0]}", echo=True)
    paro_ok = kit_stage(run)
    worker_stage(run, collectives("gloo", timeout=90), device, nccl)
    if device == "cuda":
        worker_stage(run, collectives("nccl", timeout=100), device, nccl)
    else:
        run.skip("nccl", f"{no_gpu}")
    stages = [collectives("paro", timeout=100), *EXTRA_STAGES]
    if not EXTRA_STAGES:
        run.log("(no engine parity stage yet: tests/gpu/run.py EXTRA_STAGES is empty)")
    for w in stages:
        if w.backend == "paro" and not paro_ok:
            run.skip(w.name, "paro_torch does not import (see the kit stage)")
        elif w.gpu_only and device != "cuda":
            run.skip(w.name, no_gpu)
        else:
            worker_stage(run, w, device, nccl)
    if not EXTRA_STAGES:
        run.skip("engine parity", "no worker listed yet (tests/gpu/run.py EXTRA_STAGES)")
    timing_stage(run, device, nccl, paro_ok)
    if device != "cuda":
        run.log(f"CUDA-only checks (streams, NCCL) were skipped: {no_gpu}", echo=True)
    s = run.summary
    run.log(f"== {'PASSED' if s['passed'] else 'FAILED: ' + ', '.join(s['failed_stages'])}", echo=True)  # type: ignore[arg-type]
    return 0 if s["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
