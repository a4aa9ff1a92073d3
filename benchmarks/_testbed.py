"""What the benchmarks share: the emulated cluster, launching one torchrun per node, link counters, machine facts.

Driver side (collectives.py, training.py): ``Testbed`` (``testbed.sh up/down`` as a context manager),
``torchrun_commands`` (one torchrun per node inside its namespace, or one on localhost) and ``run_launch`` (runs
them, collects the workers' ``PAROBENCH`` records, stops everything on failure or timeout), ``machine_info``,
``link_info``. Worker side (_collective_worker.py, _training_worker.py): ``read_netdev`` and ``emit``. Nothing here
imports torch at module level, so the workers can import it cheaply and the driver stays light.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TESTBED = HERE / "testbed.sh"
MARK = "PAROBENCH "
ERROR_MARK = "PAROBENCH-ERROR "  # a failing rank's reason, for the driver
SUBNET = "10.77.0"
BURST, LATENCY, MTU = "256kb", "5ms", 9000


# ------------------------------------------------------------------------------------------------- worker side
def read_netdev(ifaces: list[str]) -> dict[str, dict[str, int]]:
    """Rx/tx bytes of ``ifaces`` in this process's network namespace (missing interfaces are left out)."""
    out: dict[str, dict[str, int]] = {}
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            name = name.strip()
            if name in ifaces:
                fields = rest.split()
                out[name] = {"rx": int(fields[0]), "tx": int(fields[8])}
    return out


def emit(kind: str, **payload: Any) -> None:
    """Prints one machine-readable line for the driver."""
    print(MARK + json.dumps({"kind": kind, **payload}), flush=True)


# ------------------------------------------------------------------------------------------------- driver side
def sh(cmd: list[str]) -> str:
    """Output of a short command, or '' if it fails."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """Where the numbers come from: cores, memory, kernel, CPU, load, software versions, repository commit.

    ``packages``: distribution names whose installed versions are recorded too (read from their metadata, without
    importing them).
    """
    import torch

    import paro_torch

    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    info = {
        "nproc": int(sh(["nproc"]) or os.cpu_count() or 0),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "kernel": platform.release(),
        "cpu": cpu,
        "loadavg_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "paro_torch": getattr(paro_torch, "__version__", "?"),
        "git_commit": sh(["git", "-C", str(REPO), "rev-parse", "HEAD"]),
        "git_dirty": bool(sh(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])),
        "git_diff_sha1": hashlib.sha1(sh(["git", "-C", str(REPO), "diff", "HEAD"]).encode()).hexdigest(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for name in packages:
        info[name] = _version(name)
    return info


def link_info(nodes: int, rate: str, no_testbed: bool) -> dict[str, Any]:
    """The link settings, for the results file."""
    if no_testbed:
        return {"description": "localhost (no testbed, unshaped loopback)", "testbed": False}
    return {
        "description": f"tbf {rate} both ends",
        "testbed": True,
        "rate": rate,
        "burst": BURST,
        "latency": LATENCY,
        "mtu": MTU,
        "qdisc": "tbf on both ends of each node's veth (node->switch and switch->node); no netem (no delay)",
        "topology": f"{nodes} namespaces paro-n0..paro-n{nodes - 1}, bridge in paro-sw, veth-n<i> = {SUBNET}.<i+1>/24",
    }


def require_root(script: str) -> bool:
    """True when running as root; otherwise says why the testbed needs it and returns False."""
    if os.geteuid() == 0:
        return True
    print(
        f"{script}: the testbed needs root (network namespaces, veth, tc). Run as root, or use --no-testbed "
        "for a localhost run without shaped links.",
        file=sys.stderr,
    )
    return False


class Testbed:
    """Context manager around ``testbed.sh up/down``; tears down on exit, on errors and on SIGTERM/SIGINT."""

    def __init__(self, nodes: int, rate: str) -> None:
        self.nodes, self.rate = nodes, rate

    def __enter__(self) -> Testbed:
        try:
            subprocess.run(["bash", str(TESTBED), "up", str(self.nodes), self.rate], check=True)
        except (KeyboardInterrupt, SystemExit):  # interrupted half-way: remove what `up` recorded
            subprocess.run(["bash", str(TESTBED), "down"], check=False)
            raise
        # (a failing `up` removes its own partial setup, and must not remove a testbed someone else has up)
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["bash", str(TESTBED), "down"], check=False)


def raise_exit(signum: int, _frame: object) -> None:
    """SIGTERM handler: turn the signal into SystemExit so that finally clauses (teardown) run."""
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Installs ``raise_exit`` for SIGTERM (Ctrl-C already raises KeyboardInterrupt)."""
    signal.signal(signal.SIGTERM, raise_exit)


def ext(base: Path, suffix: str) -> Path:
    """base + suffix (Path.with_suffix would eat a rate such as '2.5gbit')."""
    return base.with_name(base.name + suffix)


def base_env(per_node: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without PARO_* / LOCAL_WORLD_SIZE, plus one thread per rank and the group size."""
    env = {key: v for key, v in os.environ.items() if not key.startswith("PARO_")}
    env.pop("LOCAL_WORLD_SIZE", None)
    env.update(OMP_NUM_THREADS="1", PARO_GROUP_SIZE=str(per_node), PYTHONUNBUFFERED="1", **(extra or {}))
    return env


def torchrun_commands(
    nodes: int, per_node: int, script: list[str], env: dict[str, str], port: int, no_testbed: bool
) -> list[tuple[list[str], dict[str, str]]]:
    """One torchrun per node inside its namespace (GLOO_SOCKET_IFNAME = its veth), or one on localhost."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    if no_testbed:
        return [([*run, "--standalone", "--nproc-per-node", str(nodes * per_node), *script],
                 dict(env, GLOO_SOCKET_IFNAME="lo"))]  # fmt: skip
    cmds = []
    for i in range(nodes):
        torchrun = [*run, "--nnodes", str(nodes), "--node-rank", str(i), "--nproc-per-node", str(per_node)]
        torchrun += ["--master-addr", f"{SUBNET}.1", "--master-port", str(port), *script]
        cmds.append((["ip", "netns", "exec", f"paro-n{i}", *torchrun], dict(env, GLOO_SOCKET_IFNAME=f"veth-n{i}")))
    return cmds


class LaunchError(RuntimeError):
    """A launch that failed or ran out of time; ``logs`` are the per-node log files, ``timed_out`` says which."""

    def __init__(self, message: str, logs: list[Path], timed_out: bool) -> None:
        super().__init__(message)
        self.logs, self.timed_out = logs, timed_out


def _pump(stream: TextIO, log: TextIO, sink: list[dict[str, Any]], on_record: Callable[[dict], None] | None) -> None:
    """Copies a torchrun's output to its log, collecting PAROBENCH records (and passing each to ``on_record``)."""
    for line in stream:
        log.write(line)
        log.flush()
        i = line.find(MARK)
        if i >= 0:
            rec = json.loads(line[i + len(MARK) :])
            sink.append(rec)
            if on_record is not None:
                on_record(rec)


def stop(procs: list[subprocess.Popen[str]]) -> None:
    """Terminates the torchruns this script started (each is its own session), then kills what is left."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def run_launch(
    name: str,
    cmds: list[tuple[list[str], dict[str, str]]],
    logdir: Path,
    timeout: float,
    on_record: Callable[[dict], None] | None = None,
    log_stem: str | None = None,
) -> list[dict[str, Any]]:
    """Runs one launch (the commands of ``torchrun_commands``) to its end; returns the records of node 0's output.

    Node i's output goes to ``logdir/<log_stem or name>.node<i>.log``. When one node fails the others are stopped
    at once (they would only wait for the process-group timeout); after ``timeout`` seconds everything is stopped.

    Raises:
        LaunchError: a node exited non-zero, no ``done`` record came, or the launch ran out of time.
    """
    stem = log_stem or name
    logdir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    procs: list[subprocess.Popen[str]] = []
    logs: list[TextIO] = []
    paths = [logdir / f"{stem}.node{i}.log" for i in range(len(cmds))]
    pump = None
    timed_out = False
    try:
        for i, (cmd, env) in enumerate(cmds):
            log = open(paths[i], "w")
            logs.append(log)
            if i == 0:
                p = subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
                assert p.stdout is not None
                pump = threading.Thread(target=_pump, args=(p.stdout, log, records, on_record), daemon=True)
                pump.start()
            else:
                p = subprocess.Popen(
                    cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
                )
            procs.append(p)
        deadline = time.time() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one node failed: the others would only wait for the process-group timeout
            if time.time() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        stop(procs)
        if pump is not None:
            pump.join(timeout=10)
        for log in logs:
            log.close()
    if timed_out:
        raise LaunchError(f"{name}: no result after {timeout:g}s; logs in {logdir}", paths, True)
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if bad or not any(r["kind"] == "done" for r in records):
        tails = []
        for i, _ in bad or [(0, None)]:
            tails.append(f"--- node {i}:\n" + paths[i].read_text()[-3000:])
        raise LaunchError(f"{name}: torchrun failed (node, rc) {bad}\n" + "\n".join(tails), paths, False)
    return records
