"""The model's step timed free (each rank on its own) against in step (a one-element all-reduce after each run).

    PARO_GROUP_SIZE=2 OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 \\
        benchmarks/investigations/probe-in-step/steps.py [partial|lora|full]

4 CPU ranks on localhost (2 cores), the training benchmark's model and scenario, one micro-batch. Per rank, in ms
per step: two free timings as the probe took them before de931cb (two warm-up runs, then runs until at least 5 and
1 s, no synchronization), three in-step timings of 8 runs with the main thread's CPU ms per step, and the overlap
probe's timing of the step alone (``measure_overlap``, loops of 2 steps, the median of 3 trials).
"""

import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _training_worker import apply_scenario, build_model  # noqa: E402

from paro_torch import auto  # noqa: E402

MODEL = {"hidden": 384, "intermediate": 1024, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096, "seq": 128}


def free_seconds(fn, repeats: int = 5, min_s: float = 1.0) -> float:
    """The probe's timing before de931cb, without a group: each rank runs until both bounds are met."""
    fn()
    fn()
    start, runs = time.perf_counter(), 0
    while runs < repeats or time.perf_counter() - start < min_s:
        fn()
        runs += 1
    return (time.perf_counter() - start) / runs


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = {"model": MODEL, "seed": 0, "scenario": sys.argv[1] if len(sys.argv) > 1 else "partial", "lora_r": 8,
           "partial_fraction": 1 / 16}  # fmt: skip
    model, _ = apply_scenario(build_model(cfg), cfg)
    x = torch.randint(0, MODEL["vocab"], (2, MODEL["seq"]))
    flag = torch.zeros(1)

    def step() -> None:
        model(input_ids=x, labels=x).loss.backward()

    res = {"free": free_seconds(step)}
    dist.barrier()
    res["free again"] = free_seconds(step)
    dist.barrier()
    for k in range(3):
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(8):
            step()
            dist.all_reduce(flag)
        res[f"in step {k}"] = (time.perf_counter() - wall) / 8
        res[f"CPU {k}"] = (time.thread_time() - cpu) / 8
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][dist.get_rank() // 2]
    loops = auto.measure_overlap(torch.device("cpu"), intra, step, align=dist.group.WORLD, loop_steps=2)
    res["overlap loop alone"] = dataclasses.astuple(loops)[0]
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, res)
    if dist.get_rank() == 0:
        for rank, r in enumerate(rows):
            print(f"rank {rank}: " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
