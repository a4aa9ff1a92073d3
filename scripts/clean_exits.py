"""Runs multi-rank workers many times in a row and counts the runs in which any rank exited non-zero (clean exits).

    python scripts/clean_exits.py --runs 50            # every case below, 50 runs each
    python scripts/clean_exits.py --runs 10 --only fsdp2,no_destroy

Each case is a worker of tests/workers that the suite expects to exit 0, on 4 ranks as 2 groups of 2, with the
arguments the suite gives it (the workers whose ranks must die, such as dead_rank.py and faults.py, are left out;
engine_errors.py's ranks catch the bad input's error on every rank and exit 0). The workers the suite starts under
torchrun (TORCHRUN_CASES) run under torchrun here too; their ranks' exit codes are torchrun's (0 when it exits 0,
else those of its failure report). Prints one table row per case: runs, failed runs, the exit codes seen ("hung":
killed after 300 s, 900 s under torchrun), seconds; the last lines of every rank of a failed run go to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from launch import launch, torchrun  # noqa: E402

CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "collectives": ("collectives.py", ()),
    "stats": ("stats.py", ()),
    "observability": ("observability.py", ("trace",)),
    "engine": ("engine.py", ("plain,frozen,lora",)),
    "engine_variants": ("engine.py", ("clip,bf16,fp16,tied,syncall",)),
    "engine_accounting": ("engine_accounting.py", ("plain,frozen,bf16",)),
    "engine_auto": ("engine_auto.py", ()),
    "engine_unsharded": ("engine_unsharded.py", ()),
    "engine_paths": ("engine_paths.py", ("ckpt_reentrant",)),
    "engine_meta_memory": ("engine_meta_memory.py", ("IIG",)),
    "checkpoint": ("checkpoint.py", ("train-save", "{tmp}", "IIG")),
    "ddp": ("frameworks.py", ("ddp",)),
    "fsdp1_full": ("frameworks.py", ("fsdp1_full",)),
    "fsdp1_hybrid": ("frameworks.py", ("fsdp1_hybrid",)),
    "fsdp2": ("frameworks.py", ("fsdp2",)),
    "hsdp": ("frameworks.py", ("hsdp",)),
    "no_destroy": ("no_destroy.py", ()),
    "exit_in_flight": ("exit_in_flight.py", ("keep",)),
    "deepspeed_zero3": ("deepspeed_zero3.py", ()),
    "tensor_lifetimes": ("tensor_lifetimes.py", ()),
    "engine_errors": ("engine_errors.py", ("disagree_model",)),
}
# run as tests/test_backend.py, test_trainer.py and test_lightning.py run them; {tmp}: a fresh directory per run
TORCHRUN_CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "entry_point": ("entry_point.py", ()),
    "hf_trainer": ("hf_trainer.py", ("{tmp}", "full,resume,lora,auto,defaults")),
    "lightning": ("lightning_worker.py", ("{tmp}", "train,resume,errors")),
}
EXTRA_ENV = {
    "engine_meta_memory": {"MALLOC_MMAP_THRESHOLD_": "131072"},  # as tests/test_engine_paths.py runs it
    "hf_trainer": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
}


def main() -> None:
    """Runs the chosen cases and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    known = [*CASES, *TORCHRUN_CASES]
    names = [n for n in args.only.split(",") if n] or known
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {known}")
    print("| case | runs | failed runs | exit codes (rank x runs) | seconds |")
    print("|---|---|---|---|---|")
    for name in names:
        script, wargs = CASES.get(name) or TORCHRUN_CASES[name]
        if script == "deepspeed_zero3.py" and importlib.util.find_spec("deepspeed") is None:
            print(f"| {name} | skipped: deepspeed is not installed | | | |")
            continue
        codes: Counter[int | str] = Counter()
        failed, start = 0, time.monotonic()
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                run_args = tuple(a.replace("{tmp}", tmp) for a in wargs)
                env = {"PARO_GROUP_SIZE": "2", **EXTRA_ENV.get(name, {})}
                if name in TORCHRUN_CASES:
                    run_codes, output = torchrun_codes(script, run_args, env)
                    codes.update(run_codes)
                    if run_codes != [0] * 4:
                        failed += 1
                        print(f"{name}: exit codes {run_codes}:\n{output[-4000:]}", file=sys.stderr, flush=True)
                    continue
                try:
                    results = launch(script, 4, env=env, args=run_args, timeout=300)
                except AssertionError as e:  # a hang: launch killed every rank
                    codes["hung"] += 4
                    failed += 1
                    print(f"{name}: {e}", file=sys.stderr, flush=True)
                    continue
            codes.update(r.returncode for r in results)
            if any(r.returncode != 0 for r in results):
                failed += 1
                for r in results:  # what a failed run said, for the diagnosis
                    tail = "\n".join(r.output.splitlines()[-20:])
                    print(f"{name}: rank {r.rank} exit {r.returncode}:\n{tail}", file=sys.stderr, flush=True)
        seen = ", ".join(f"{c}: {k}" for c, k in sorted(codes.items(), key=lambda ck: str(ck[0])))
        print(f"| {name} | {args.runs} | {failed} | {seen} | {time.monotonic() - start:.0f} |", flush=True)


def torchrun_codes(script: str, args: tuple[str, ...], env: dict[str, str]) -> tuple[list[int | str], str]:
    """Runs ``tests/workers/<script>`` under torchrun on 4 local ranks: (the ranks' exit codes, the output)."""
    code, output = torchrun(script, args, env, timeout=900)
    if code is None:
        return ["hung"] * 4, output
    if code == 0:
        return [0] * 4, output
    # torchrun's failure report: one "exitcode : N (pid: ...)" per failed rank; the others count as 0
    failed: list[int | str] = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]
    return (failed or [f"torchrun {code}"]) + [0] * (4 - max(len(failed), 1)), output


if __name__ == "__main__":
    main()
