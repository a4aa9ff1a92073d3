"""The ``paro`` backend's worker thread never frees a caller's tensor (clean exits).

Freeing a tensor whose Python object has died takes the GIL; a thread that does so while the interpreter exits
ends inside a noexcept destructor and the process aborts ("terminate called without an active exception"). Each
pattern below drops the last Python reference to a collective's tensor at a different moment; a finalizer records
the thread that freed it. Before the fix, about 1 in 6 was freed on the worker.
"""

import threading
import weakref

import torch
import torch.distributed as dist

import paro_torch  # noqa: F401  (registers "paro")

ROUNDS = 300
MAIN = threading.get_ident()
freed_on_main: list[bool] = []


def tracked(t: torch.Tensor) -> torch.Tensor:
    weakref.finalize(t, lambda: freed_on_main.append(threading.get_ident() == MAIN))
    return t


def main() -> None:
    dist.init_process_group("paro")
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.ones(8)
    for _ in range(ROUNDS):
        out = tracked(torch.empty(8 * world))  # output, dropped after wait()
        work = dist.all_gather_into_tensor(out, shard, async_op=True)
        work.wait()
        del work, out
        # input dropped by Python before the collective has run; waited through the Future
        work = dist.all_gather_into_tensor(torch.empty(8 * world), tracked(torch.full((8,), 2.0)), async_op=True)
        work.get_future().wait()
        del work
        dist.all_reduce(tracked(torch.ones(16)))  # synchronous, result never kept
    dist.barrier()
    total = 3 * ROUNDS
    off_main = freed_on_main.count(False)
    assert len(freed_on_main) == total, f"rank {rank}: {total - len(freed_on_main)} of {total} tensors still held"
    assert off_main == 0, f"rank {rank}: {off_main} of {total} tensors were freed off the main thread"
    print(f"rank {rank}: {total} tensors, all freed on the main thread")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
