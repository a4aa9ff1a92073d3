"""The link probe's rounds, one by one: what each round of ``measure_links`` reads and the median it returns.

Run one torchrun per emulated node (benchmarks/testbed.sh), e.g. 2 x 4 at 1 Gbit/s:

    for i in 0 1; do ip netns exec paro-n$i env OMP_NUM_THREADS=1 PARO_GROUP_SIZE=4 GLOO_SOCKET_IFNAME=veth-n$i \\
        PYTHONPATH=. python3 -m torch.distributed.run --nnodes 2 --node-rank $i --nproc-per-node 4 \\
        --master-addr 10.77.0.1 --master-port 29611 benchmarks/investigations/probe-rounds/rounds.py 8 & done; wait
"""

import sys

import torch
import torch.distributed as dist

from paro_torch import auto


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    groups, device = auto.probe_groups(), torch.device("cpu")
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    every = []
    for r in range(rounds):
        t = auto._link_round(groups, 4 << 10, 16 << 20, 5, device)
        every.append(t)
        if dist.get_rank() == 0:
            print(f"round {r}: " + line(t), flush=True)
    if dist.get_rank() == 0:
        for n in (3, rounds):
            print(f"median of rounds 0-{n - 1}: " + line(torch.quantile(torch.stack(every[:n]), 0.5, dim=0)))
    dist.destroy_process_group()


def line(t: torch.Tensor) -> str:
    """The figures of a round (``auto._link_round``'s order) in MB/s and ms."""
    return (
        f"intra {-t[2] / 1e6:5.0f} MB/s (reduce-scatter {-t[4] / 1e6:5.0f}) {t[0] * 1e3:5.2f} ms | "
        f"inter {-t[3] / 1e6:5.1f} MB/s (reduce-scatter {-t[5] / 1e6:5.1f}) {t[1] * 1e3:5.2f} ms"
    )


if __name__ == "__main__":
    main()
