"""The model probe three times in one launch: the training benchmark's model, 4 CPU ranks as 2 groups of 2.

    PYTHONPATH=. torchrun --standalone --nproc-per-node 4 benchmarks/investigations/probe-repeat/probes.py \\
        benchmarks/investigations/probe-repeat/calibration-2x2-1gbit-ilv.json

``SC`` picks the scenario (``lora``, the default, ``partial`` or ``full``); ``MIN_S`` times the model's step and
AdamW for at least that many seconds (the probe's default: 1).
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _training_worker import apply_scenario, build_model  # noqa: E402

from paro_torch import auto  # noqa: E402
from paro_torch.auto import LinkCalibration  # noqa: E402

MODEL = {"hidden": 384, "intermediate": 1024, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 4096, "seq": 128}


def main() -> None:
    if os.environ.get("MIN_S"):
        timed = auto._mean_seconds
        auto._mean_seconds = lambda fn, repeats, group, device, min_s=1.0: timed(  # (device: since de931cb)
            fn, repeats, group, device, float(os.environ["MIN_S"])
        )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = {"model": MODEL, "seed": 0, "scenario": os.environ.get("SC", "lora"), "lora_r": 8, "partial_fraction": 1 / 16}
    model, _ = apply_scenario(build_model(cfg), cfg)
    x = torch.randint(0, MODEL["vocab"], (2, MODEL["seq"]))
    groups = auto.probe_groups(2)
    links = LinkCalibration.load(sys.argv[1])
    for i in range(3):
        t0 = time.perf_counter()
        got = auto.probe_model(links, groups, model, {"input_ids": x, "labels": x}, 1e9, torch.device("cpu"))
        loops = " ".join(f"{row[0]:.4f}" for row in got.overlap_loops.values())
        if dist.get_rank() == 0:
            print(
                f"probe {i}: step {1e9 / got.compute_flops:.4f} s (loops' steps {loops}), "
                f"intra slowdown {got.intra.slowdown:.2f} "
                f"rs {got.intra.reduce_scatter_slowdown:.2f} overlap {got.intra.overlap:.2f}, "
                f"inter slowdown {got.inter.slowdown:.2f}, adamw {got.optimizer_params_per_s / 1e6:.1f} M/s "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
