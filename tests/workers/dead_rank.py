"""A rank that dies (``exit``) or stops answering (``stuck``) makes the others fail with an error, not hang."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import paro_torch  # noqa: F401


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("paro", timeout=datetime.timedelta(seconds=15))
    rank = dist.get_rank()
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == 1:
        if mode == "stuck":
            time.sleep(25)  # longer than the 15 s timeout: the others must give up first
        os._exit(3)
    start = time.monotonic()
    try:
        for _ in range(3):
            dist.all_reduce(t)
            dist.all_gather_into_tensor(torch.empty(1000 * dist.get_world_size()), t)
    except Exception as e:  # noqa: BLE001
        print(f"rank {rank}: error raised after {time.monotonic() - start:.1f}s: {type(e).__name__}: {str(e)[:200]}")
        os._exit(0)
    print(f"rank {rank}: no error")
    os._exit(1)


if __name__ == "__main__":
    main()
