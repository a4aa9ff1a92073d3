"""Runs a worker of the CPU suite (tests/workers) on this stage's device, as one rank.

    suite_worker.py --backend BACKEND --device cpu|cuda WORKER [ARGS ...]

The worker reads the device from PARO_TEST_DEVICE (tests/workers/_device.py) and chooses its own backend; BACKEND
only tells run.py which environment the stage needs (NCCL's, for nccl and paro). Prints a CHECK line when the
worker exits 0.
"""

import argparse
import os
import runpy
import sys
from pathlib import Path

WORKERS = Path(__file__).resolve().parents[1] / "workers"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--device", required=True, choices=["cpu", "cuda"])
    p.add_argument("worker")
    p.add_argument("args", nargs="*")
    a = p.parse_args()
    os.environ["PARO_TEST_DEVICE"] = a.device
    sys.path[:0] = [str(WORKERS), str(WORKERS.parents[1])]  # the workers' helpers; the checkout's paro_torch
    sys.argv = [str(WORKERS / a.worker), *a.args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    print(f"CHECK {a.worker} {' '.join(a.args)} on {a.device}: ok".replace("  ", " "), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
