"""Shared by the GPU check workers: process-group setup for a backend and device, and check bookkeeping.

Each worker is a plain script started once per rank (``tests/gpu/run.py`` launches them); every check prints one
line ``CHECK <name>: ok | FAIL <reason> | skipped: <reason>``, which the driver collects into the summary.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the checkout's paro_torch (on the GPU machine it is not installed)
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def parse_args(extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True, choices=["gloo", "nccl", "paro"])
    p.add_argument("--device", required=True, choices=["cpu", "cuda"])
    if extra:
        extra(p)
    return p.parse_args()


def init(backend: str, device: str) -> tuple[int, int, torch.device]:
    """Joins the process group (env:// rendezvous); every rank uses cuda:0 on a GPU run."""
    if backend == "paro":
        import paro_torch  # noqa: F401  (registers the backend; not installed there, so no entry point)
    if device == "cuda":
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), dev


class Checks:
    """Runs named checks, prints one CHECK line each and keeps going after a failure."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failed = 0

    def run(self, name: str, fn: Callable[[], str | None]) -> None:
        """``fn`` returns None when it passed, or a string starting with "skipped:" when it did not apply."""
        try:
            note = fn()
        except Exception as e:  # noqa: BLE001  (report and go on with the next check)
            self.failed += 1
            first = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(f"CHECK {name}: FAIL {first}", flush=True)
            traceback.print_exc(limit=4)
            sys.stderr.flush()
            return
        print(f"CHECK {name}: {note if note else 'ok'}", flush=True)

    def skip(self, name: str, why: str) -> None:
        print(f"CHECK {name}: skipped: {why}", flush=True)

    def finish(self) -> None:
        """Ends the process group and exits non-zero when a check failed."""
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            print(f"destroy_process_group failed: {e}", flush=True)
        print(f"rank {self.rank}: {self.failed} check(s) failed", flush=True)
        sys.stdout.flush()
        os._exit(1 if self.failed else 0)


def assert_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        diff = "-"
        if got.shape == want.shape and got.numel():
            diff = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{name}: mismatch (max |diff| {diff}); got {got.flatten()[:6]} want {want.flatten()[:6]}")
