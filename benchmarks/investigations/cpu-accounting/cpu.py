"""Where a CPU rank's time goes: the model's step alone against the engine's training step, in CPU seconds.

    PARO_GROUP_SIZE=2 OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 \\
        benchmarks/investigations/cpu-accounting/cpu.py [lora|partial] [NNN]

4 CPU ranks as 2 groups of 2 on localhost, the training benchmark's model and scenario. Per rank: the model's
forward and backward alone (every rank at once, an all-reduce of one number after each, as the probe's ranks share
the cores), then the engine's training steps (2 micro-steps, clipping, AdamW): wall seconds per step, and CPU seconds
per step of the main thread and of all the process's other threads (the engine's lanes, Gloo's), from /proc.
"""

import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _training_worker import apply_scenario, build_model, decoder_layer_class  # noqa: E402

from paro_torch import ParoShardedModule  # noqa: E402

MODEL = {"hidden": 384, "intermediate": 1024, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096, "seq": 128}


def threads_cpu() -> float:
    """CPU seconds of this process's threads other than the calling one."""
    me, total = str(threading.get_native_id()), 0.0
    for tid in os.listdir("/proc/self/task"):
        if tid == me:
            continue
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main() -> None:
    scenario = sys.argv[1] if len(sys.argv) > 1 else "lora"
    strategy = sys.argv[2] if len(sys.argv) > 2 else "NNN"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = {"model": MODEL, "seed": 0, "scenario": scenario, "lora_r": 8, "partial_fraction": 1 / 16}
    model, _ = apply_scenario(build_model(cfg), cfg)
    x = torch.randint(0, MODEL["vocab"], (2, MODEL["seq"]))
    flag = torch.zeros(1)

    def model_step() -> None:
        model(input_ids=x, labels=x).loss.backward()
        dist.all_reduce(flag)

    for _ in range(3):
        model_step()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(10):
        model_step()
    alone = [(time.perf_counter() - wall) / 10, (time.thread_time() - cpu) / 10]
    model.zero_grad(set_to_none=True)

    wrapped = ParoShardedModule(model, strategy, wrap_policy={decoder_layer_class()}, grad_accum=2)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)

    def train_step() -> None:
        for i in range(2):
            with wrapped.no_sync() if i == 0 else torch.enable_grad():
                (wrapped(input_ids=x, labels=x).loss / 2).backward()
        wrapped.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        train_step()
    wall, cpu, others = time.perf_counter(), time.thread_time(), threads_cpu()
    for _ in range(8):
        train_step()
    trained = [(time.perf_counter() - wall) / 8, (time.thread_time() - cpu) / 8, (threads_cpu() - others) / 8]
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (alone, trained))
    if dist.get_rank() == 0:
        print(f"{scenario} {strategy}, ms per step (model step alone: one forward and backward; training: two)")
        for rank, (a, t) in enumerate(rows):
            print(f"rank {rank}: model step wall {a[0] * 1e3:.0f}, main thread CPU {a[1] * 1e3:.0f} | "
                  f"training step wall {t[0] * 1e3:.0f}, main thread CPU {t[1] * 1e3:.0f}, "
                  f"other threads CPU {t[2] * 1e3:.0f}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
