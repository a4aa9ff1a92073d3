"""Small inter-group all-gathers (4 KiB) timed one by one: fresh, right after a 16 MiB all-gather, after 0.5 s idle.

Prints, per series, each call's slowest rank (ms) and each rank's median. Launch as busy.py (one torchrun per node).
"""

import time

import torch
import torch.distributed as dist

from paro_torch import auto


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    groups, device = auto.probe_groups(), torch.device("cpu")
    small = auto._collective("all_gather", groups.inter, 4 << 10, device)
    large = auto._collective("all_gather", groups.inter, 16 << 20, device)

    def series(n: int, barrier: bool = True) -> list[float]:
        out = []
        for _ in range(n):
            if barrier:
                dist.barrier(group=groups.inter)
            start = time.perf_counter()
            small()
            out.append(time.perf_counter() - start)
        return out

    small()
    small()
    found = {"fresh, barrier": series(10), "fresh, no barrier": series(10, barrier=False)}
    large()
    found["after bulk, barrier"] = series(10)
    large()
    found["after bulk, no barrier"] = series(10, barrier=False)
    dist.barrier(group=groups.whole)
    time.sleep(0.5)
    found["after 0.5 s idle, barrier"] = series(10)
    for name, seconds in found.items():
        t = torch.tensor(seconds, dtype=torch.float64)
        every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(every, t)
        if dist.get_rank() == 0:
            m = torch.stack(every) * 1e3
            slowest = " ".join(f"{x:5.1f}" for x in m.max(0).values.tolist())
            print(f"{name:26} {slowest} | median per rank {[round(float(x), 2) for x in m.median(1).values]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
