"""Times paro's collectives on one rank (``--device cuda|cpu``); the driver runs it with PARO_MAX_CHUNKS=1 and with
the default (pipelined) and prints both side by side. Rank 0 prints one ``TIMING {json}`` line per collective and size.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from _common import init, parse_args


def main() -> None:
    args = parse_args(lambda p: p.add_argument("--iters", type=int, default=5))
    rank, world, dev = init(args.backend, args.device)
    cuda = dev.type == "cuda"
    sizes_mib = [1, 16, 64] if cuda else [1, 8]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for mib in sizes_mib:
        n = mib * (1 << 20) // 4 // world * world  # float32 elements, divisible by the world
        x = torch.ones(n, device=dev)
        shard = torch.ones(n // world, device=dev)
        ops = {
            "all_reduce": lambda x=x: dist.all_reduce(x),
            "all_gather_into_tensor": lambda x=x, shard=shard: dist.all_gather_into_tensor(x, shard),
            "reduce_scatter_tensor": lambda x=x, shard=shard: dist.reduce_scatter_tensor(shard, x),
        }
        for name, op in ops.items():
            op()  # warm-up (connections, buffers)
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                op()
            sync()
            ms = (time.perf_counter() - t0) / args.iters * 1e3
            if rank == 0:
                row = {"op": name, "mib": mib, "ms": ms, "max_chunks": os.environ.get("PARO_MAX_CHUNKS", "default")}
                print("TIMING " + json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
