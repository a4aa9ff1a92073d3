"""PyTorch's distributed test suite on a backend, and the side-by-side report (used by scripts/conformance.sh).

As a pytest module (env BACKEND, WORLD_SIZE, TEMP_DIR, INIT_METHOD set): defines the test class of PyTorch's
test/distributed/test_distributed_spawn.py, ``TestDistBackend`` + ``DistributedTest._DistTestBase`` from
torch/testing/_internal/distributed/distributed_test.py, each test spawning WORLD_SIZE ranks that re-import
this module. For a plugin backend (any BACKEND but gloo, nccl, ucc, mpi) it first imports paro_torch (which
registers "paro") and gives the backend every feature gloo has: it joins gloo in ``DistTestCases``' sets and
the profiling allowlists (unless PARO_CONFORMANCE_PROFILING=0), and distributed_test.py is loaded with every
comparison ``BACKEND ==/!=/in/not in`` (the suite's gates, e.g. "Only gloo backend supports timeouts") reading
"gloo" instead.

    python scripts/conformance.py report GLOO.xml PARO.xml --out RESULTS.md   # compare two junit files
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BUILTIN = ("gloo", "nccl", "ucc", "mpi")
SUITE = "torch.testing._internal.distributed.distributed_test"
# A failed check of the backend's name: torch reports a plugin backend's process group as "custom".
NAME_CHECK = re.compile(r"'custom' != '\w+'")


def _load_suite(backend: str):
    """Imports distributed_test.py, for a plugin backend with its gates reading "gloo"."""
    if backend in BUILTIN:
        return importlib.import_module(SUITE)
    from torch.testing._internal import common_distributed

    for sets in (common_distributed.DistTestCases.backend_feature, common_distributed.DistTestCases.skip_collective):
        for names in sets.values():
            if "gloo" in names:
                names.add(backend)
    common_distributed.DistTestCases.backend_feature["plugin"].add(backend)

    spec = importlib.util.spec_from_file_location(SUITE, importlib.util.find_spec(SUITE).origin)
    source = Path(spec.origin).read_text()
    source, gates = re.subn(r"\bBACKEND(?= (?:==|!=|in|not in) )", "_GATE_BACKEND", source)
    if gates < 100:
        raise RuntimeError(f"{spec.origin}: only {gates} backend gates found; has the suite changed?")
    module = importlib.util.module_from_spec(spec)
    module._GATE_BACKEND = "gloo"
    sys.modules[SUITE] = module
    # Same file and line numbers in tracebacks; dont_inherit: not this file's `from __future__ import annotations`
    exec(compile(source, spec.origin, "exec", dont_inherit=True), module.__dict__)
    if os.environ.get("PARO_CONFORMANCE_PROFILING", "1") != "0":  # conformance.sh -P: not
        for allowlist in ("PROFILING_SUPPORTED_BACKENDS", "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
            getattr(module, allowlist).append(backend)
    return module


def _make_test_class() -> None:
    """Defines TestDistBackendWithSpawn<BACKEND> at module level, as test_distributed_spawn.py does."""
    import torch

    backend = os.environ["BACKEND"]
    if backend == "paro":
        import paro_torch  # noqa: F401  (registers the backend, in the parent and in every spawned rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    suite = _load_suite(backend)

    class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    name = f"TestDistBackendWithSpawn{backend.upper()}"
    TestDistBackendWithSpawn.__name__ = TestDistBackendWithSpawn.__qualname__ = name
    globals()[name] = TestDistBackendWithSpawn


def read_junit(path: Path) -> dict[str, tuple[str, list[str]]]:
    """Test name -> (pass/fail/skip, the key lines of its failure) from a pytest junit XML file."""
    results = {}
    for case in ET.parse(path).iter("testcase"):
        outcome, lines = "pass", []
        for tag, kind in (("failure", "fail"), ("error", "fail"), ("skipped", "skip")):
            node = case.find(tag)
            if node is not None:
                outcome = kind
                if kind == "fail":
                    lines = _key_lines(node.get("message", ""), node.text or "", case.findtext("system-err") or "")
                break
        results[case.get("name")] = (outcome, lines)
    return results


def _key_lines(message: str, details: str, stderr: str) -> list[str]:
    """Per distinct error: the ranks, the suite's line that raised and the exception; else the error lines logged."""
    text = "\n".join(line[12:] for line in details.splitlines() if line.startswith("E "))  # pytest's "E" + 11 spaces
    parts = re.split(r"^(?:RuntimeError: )?Process (\d+) exited with error code \d+ and exception:$", text, flags=re.M)
    errors: dict[tuple[str, ...], list[str]] = {}
    for rank, block in zip(parts[1::2], parts[2::2], strict=True):
        lines = block.splitlines()
        frames = []  # (file, line, function: code) of each frame, outermost first
        for i, line in enumerate(lines[:-1]):
            frame = re.match(r'  File ".*?([^/]+/[^/]+\.py)", line (\d+), in (\S+)', line)
            if frame:
                frames.append("{}:{} {}: ".format(*frame.groups()) + lines[i + 1].strip())
        where = [f for f in frames if "/distributed_test.py" in f][-1:]  # the suite's line, and where it raised
        where += [f for f in frames[-1:] if f not in where and not re.match(r"_internal/common_utils|unittest/", f)]
        skip = ("Traceback", "During handling", "The above exception")
        exc = [line for line in lines if line and not line.startswith((" ", *skip))]
        exc = exc[: next((i for i, line in enumerate(exc) if line.startswith("To execute")), len(exc))]
        errors.setdefault(tuple(where + exc[:6]), []).append(rank)
    if errors:
        return [f"ranks {','.join(r)}: " + " | ".join(k) for k, r in errors.items()]
    logged = [re.sub(r"^\[rank\d+\]:\S+ \S+ \d+ \S+\] ", "", line) for line in stderr.splitlines()]
    logged = [line for line in logged if re.search(r"Error|error|Exception|Timing out|timed out|Abort|Signal", line)]
    return [message.splitlines()[0] if message else "?", *list(dict.fromkeys(logged))[-8:]]


def report(gloo_xml: Path, paro_xml: Path, out: Path) -> int:
    """Writes the per-test table; returns 1 when a test passes on gloo and fails on paro (name checks aside)."""
    runs = {"gloo": read_junit(gloo_xml), "paro": read_junit(paro_xml)}
    names = sorted(set(runs["gloo"]) | set(runs["paro"]))
    outcome = {b: {n: r.get(n, ("-", []))[0] for n in names} for b, r in runs.items()}
    count = {b: {k: list(o.values()).count(k) for k in ("pass", "fail", "skip")} for b, o in outcome.items()}
    worse = [n for n in names if outcome["gloo"][n] == "pass" and outcome["paro"][n] != "pass"]
    allowed = [n for n in worse if any(NAME_CHECK.search(line) for line in runs["paro"][n][1])]
    worse = [n for n in worse if n not in allowed]
    both = [n for n in names if outcome["gloo"][n] == outcome["paro"][n] == "fail"]
    lines = [
        "# Conformance: PyTorch's distributed test suite on gloo and on paro",
        "",
        f"`bash scripts/conformance.sh`: DistributedTest._DistTestBase of torch {_torch_version()}'s "
        "distributed_test.py, 4 CPU ranks; paro with PARO_GROUP_SIZE=2 (2 groups of 2).",
        "",
        "| backend | pass | fail | skip |",
        "|---|---|---|---|",
        *(f"| {b} | {c['pass']} | {c['fail']} | {c['skip']} |" for b, c in count.items()),
        "",
        f"## Pass on gloo, fail on paro: {len(worse)}",
        "",
    ]
    for n in allowed:
        lines += [f"- allowed, checks the backend's name: `{n}`: {runs['paro'][n][1][0]}"]
    for n in worse:
        lines += [f"- `{n}`", "  ```", *(f"  {line}" for line in runs["paro"][n][1]), "  ```"]
    lines += ["", f"## Fail on both: {len(both)}", ""]
    for n in both:
        lines += [f"- `{n}`: {(runs['paro'][n][1] or ['?'])[0]}"]
    lines += ["", "## Every test", "", "| test | gloo | paro |", "|---|---|---|"]
    lines += [f"| {n} | {outcome['gloo'][n]} | {outcome['paro'][n]} |" for n in names]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    for b, c in count.items():
        print(f"{b}: {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped")
    print(f"pass on gloo, fail on paro ({len(worse)}): {' '.join(worse) or '-'}")
    print(f"allowed (backend name): {' '.join(allowed) or '-'}; fail on both ({len(both)}): {' '.join(both) or '-'}")
    print(f"table: {out}")
    return 1 if worse else 0


def _torch_version() -> str:
    import torch

    return torch.__version__


if os.environ.get("BACKEND"):
    _make_test_class()

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["report"])
    parser.add_argument("gloo_xml", type=Path)
    parser.add_argument("paro_xml", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.exit(report(args.gloo_xml, args.paro_xml, args.out))
