"""A call's time alone and beside compute, by level and size: what the busy latency of the overlap probe measures.

Each level's all-gathers of 4 KiB, 256 KiB and 4 MiB (``paro_torch.auto.measure_overlap`` with an MLP block as the
compute, loops of at least two steps), the ranks' median of each figure, per call. Run one torchrun per emulated
node (benchmarks/testbed.sh), e.g. 2 x 2 at 1 Gbit/s:

    for i in 0 1; do ip netns exec paro-n$i env OMP_NUM_THREADS=1 PARO_GROUP_SIZE=2 GLOO_SOCKET_IFNAME=veth-n$i \\
        PYTHONPATH=. python3 -m torch.distributed.run --nnodes 2 --node-rank $i --nproc-per-node 2 \\
        --master-addr 10.77.0.1 --master-port 29617 benchmarks/investigations/busy-latency/busy.py & done; wait
"""

import torch
import torch.distributed as dist

from paro_torch import auto

SIZES = (4 << 10, 256 << 10, 4 << 20)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    groups, device = auto.probe_groups(), torch.device("cpu")
    rows = []
    for level in ("intra", "inter"):
        for nbytes in SIZES:
            pg = getattr(groups, level)
            loops = auto.measure_overlap(device, pg, nbytes=nbytes, align=groups.whole, loop_steps=2)
            per_call = [loops.collectives, loops.collectives_beside, loops.lost_seconds()]
            rows.append([x / loops.calls for x in per_call] + [loops.step])
    t = torch.tensor(rows, dtype=torch.float64)
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    median = torch.quantile(torch.stack(every), 0.5, dim=0)
    if dist.get_rank() == 0:
        names = [(level, nbytes) for level in ("intra", "inter") for nbytes in SIZES]
        for (level, nbytes), (alone, beside, lost, step) in zip(names, median.tolist(), strict=True):
            print(
                f"{level} {nbytes >> 10:5d} KiB: per call alone {alone * 1e3:6.2f} ms, beside compute "
                f"{beside * 1e3:6.2f} ms, compute lost per call {lost * 1e3:6.2f} ms (step {step * 1e3:.1f} ms)"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
