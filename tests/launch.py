"""Starts N ranks of a worker script as plain processes (env:// rendezvous) and collects their results."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    script: str, world: int, *, env: dict[str, str] | None = None, args: tuple[str, ...] = (), timeout: float = 600
) -> list[RankResult]:
    """Runs ``workers/<script>`` on ``world`` ranks; kills them all if they exceed ``timeout`` seconds.

    The rendezvous port is picked free and released before rank 0 binds it, so another program can take it in
    between: then rank 0 fails with EADDRINUSE while the others wait for its store, and the launch is retried on
    another port (up to 3 times).
    """
    for _ in range(3):
        results = _launch_once(script, world, env, args, timeout)
        if results is not None:
            return results
    raise AssertionError(f"{script}: rank 0 found its rendezvous port taken 3 times in a row")


def _launch_once(
    script: str, world: int, env: dict[str, str] | None, args: tuple[str, ...], timeout: float
) -> list[RankResult] | None:
    """One launch; None when rank 0 could not bind the rendezvous port (the other ranks are then killed)."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ)
        e.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        e.pop("LOCAL_WORLD_SIZE", None)
        e.update(env or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKERS / script), *args],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    try:
        for rank, p in enumerate(procs):
            out, _ = p.communicate(timeout=timeout)
            if rank == 0 and p.returncode != 0 and "EADDRINUSE" in out and "TCPStore" in out:
                for q in procs:
                    q.kill()
                    q.communicate()
                return None
            results.append(RankResult(rank, p.returncode, out))
    except subprocess.TimeoutExpired as err:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        tails = "\n".join(o[-2000:] for o in outs)
        raise AssertionError(f"{script} on {world} ranks hung for {timeout}s:\n{tails}") from err
    return results


def assert_ok(results: list[RankResult]) -> str:
    """Fails with every failing rank's output; returns rank 0's output."""
    bad = [r for r in results if r.returncode != 0]
    if bad:
        raise AssertionError("\n".join(f"--- rank {r.rank} exited {r.returncode}:\n{r.output[-4000:]}" for r in bad))
    return results[0].output


@dataclass(frozen=True)
class Case:
    """One worker run as a case of a shared launch: ``workers/<script> ARGS`` with ``env`` added, at most ``limit_s``
    seconds (it must have a ``main()``: see workers/cases.py)."""

    script: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    limit_s: float = 300


NOT_RUN = -1000
"""The exit code of a case that did not run: an earlier case of its launch failed."""


@dataclass(frozen=True)
class Shared:
    """Cases (by the name of the test that reads them) that share one launch of ``world`` ranks: each rank runs them
    one after another in one process (workers/cases.py), so that start-up (imports, rendezvous) is paid once.

    ``hard_exit``: the ranks skip the interpreter's teardown at the end, as checkpoint.py does when run alone.
    """

    world: int
    cases: dict[str, Case]
    env: dict[str, str] = field(default_factory=dict)
    hard_exit: bool = False

    @property
    def timeout_s(self) -> float:
        """The launch's bound, every case at its limit, start-up included."""
        return sum(c.limit_s for c in self.cases.values()) + 120

    def run(self, names: set[str]) -> dict[str, list[RankResult]]:
        """Runs the cases named, in their order here; each case's results as ``launch`` would give them alone."""
        cases = {n: c for n, c in self.cases.items() if n in names}
        if not cases:
            return {}
        spec = {"cases": [[n, c.script, list(c.args), c.env, c.limit_s] for n, c in cases.items()]}
        spec["hard_exit"] = self.hard_exit
        timeout = sum(c.limit_s for c in cases.values()) + 120
        results = launch("cases.py", self.world, env=self.env, args=(json.dumps(spec),), timeout=timeout)
        return {name: [_case_result(r, name) for r in results] for name in cases}


def _case_result(r: RankResult, name: str) -> RankResult:
    """Case ``name``'s part of rank ``r``'s output, with its exit code (workers/cases.py frames each case)."""
    begins = f"@@case {name} begins\n"
    start = r.output.find(begins)
    if start < 0:
        said = f"case {name} did not run: its launch stopped before it (rank {r.rank} exited {r.returncode})"
        return RankResult(r.rank, NOT_RUN, f"{said}\n{r.output[-4000:]}")
    body = r.output[start + len(begins) :]
    end = re.search(rf"^@@case {re.escape(name)} exited (-?\d+)", body, re.MULTILINE)
    if end is None:  # it ended the process: a crash, or past its time limit
        return RankResult(r.rank, r.returncode or 1, body)
    return RankResult(r.rank, int(end.group(1)), body[: end.start()])


def torchrun_command(script: Path, *args: str, options: tuple[str, ...] = ()) -> list[str]:
    """The command that runs ``script ARGS`` under torchrun (with its ``options``) on 4 local ranks."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *options]
    return [*run, str(script), *args]


def torchrun(
    script: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None, timeout: float = 540
) -> tuple[int | None, str]:
    """Runs ``workers/<script> ARGS`` under torchrun on 4 local ranks: (its exit code, None if it hung; its output)."""
    e = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    e.pop("LOCAL_WORLD_SIZE", None)
    cmd = torchrun_command(WORKERS / script, *args)
    try:
        done = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:  # its captured output is bytes even with text=True
        said = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (err.stdout, err.stderr)]
        return None, "".join(said)
    return done.returncode, f"{done.stdout}\n{done.stderr}"


def torchrun_checks(script: str, out: Path, checks: tuple[str, ...], env: dict[str, str], timeout: float = 540) -> str:
    """Runs ``workers/<script> OUT CHECK,...`` under torchrun on 4 local ranks; returns its exit line and output.

    For workers that run several checks in one launch (start-up dominates on 2 cores), each printing
    ``CHECK <name> ok: ...`` on rank 0 (read with ``assert_check``).
    """
    code, output = torchrun(script, (str(out), ",".join(checks)), env, timeout)
    return f"torchrun hung for {timeout}s:\n{output}" if code is None else f"torchrun exited {code}\n{output}"


def rank0_errors(output: str) -> str:
    """The last lines rank 0 printed (its traceback), else the output's tail."""
    errors = [line for line in output.splitlines() if line.startswith("[rank0]")]
    return "\n".join(errors[-40:]) or output[-6000:]


def assert_check(output: str, name: str) -> None:
    """Fails unless rank 0 reported check ``name`` as passed in a ``torchrun_checks`` output; prints its line."""
    lines = [line for line in output.splitlines() if line.startswith(f"CHECK {name} ok")]
    assert lines, f"check {name!r} did not pass:\n{rank0_errors(output)}"
    print(lines[0])
