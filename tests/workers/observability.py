"""Observability of ``paro`` collectives (docs/backend.md, "Profiling, debugging and errors").

``trace``: every collective is a torch.profiler event ``paro:<op>`` with its input shapes and sequence number, and
each plan step an event ``paro:<level>:<kind>`` with its sizes; the group's sequence number counts collectives.
``desync``: rank 1 issues a different collective than the others; every rank's error names its own collective and
sequence number (with TORCH_DISTRIBUTED_DEBUG=DETAIL, torch's checker names the mismatch before anything runs).
``monitored``: rank 1 never reaches a monitored barrier; rank 0's error names it, as on Gloo.
``stats``: the counters work under TORCH_DISTRIBUTED_DEBUG=DETAIL (torch wraps the backend in its checker).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import paro_torch


def group_seq(pg: dist.ProcessGroup) -> int:
    """The group's sequence number: torch before 2.14 asks only Gloo, NCCL and UCC through the ProcessGroup, so there
    the paro backend is asked directly."""
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.14":
        return pg._get_sequence_number_for_group()
    return pg._get_backend(torch.device("cpu"))._get_sequence_number_for_group()


def trace() -> None:
    dist.init_process_group("paro")
    world = dist.get_world_size()
    pg = dist.group.WORLD
    assert group_seq(pg) == 0
    t = torch.ones(1000)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(t, async_op=True).wait()
        dist.all_gather_into_tensor(torch.empty(1000 * world), t)
        peer = dist.get_rank() ^ 1  # point-to-point: events of their own, with their tensors
        for op in (dist.isend, dist.irecv) if peer > dist.get_rank() else (dist.irecv, dist.isend):
            op(torch.ones(7), peer).wait()
    assert group_seq(pg) == 2, group_seq(pg)
    events = [e for e in prof.events() if e.name.startswith("paro:")]
    ops = {e.name: e for e in events if e.name.count(":") == 1}
    assert set(ops) == {"paro:all_reduce", "paro:all_gather_into_tensor", "paro:send", "paro:recv"}, sorted(ops)
    assert ops["paro:send"].input_shapes == ops["paro:recv"].input_shapes == [[7]]
    assert all(e.is_async for e in ops.values())
    assert ops["paro:all_reduce"].input_shapes == [[1000]], ops["paro:all_reduce"].input_shapes
    assert ops["paro:all_reduce"].kwinputs == {"seq": 1}, ops["paro:all_reduce"].kwinputs
    assert ops["paro:all_gather_into_tensor"].kwinputs == {"seq": 2}
    steps = {(e.name, tuple(map(tuple, e.input_shapes))) for e in events if e.name.count(":") == 2}
    # all_gather of 1000 floats on 2 x 2: inter step (1000 -> 2000), then intra step (2000 -> 4000)
    assert ("paro:inter:all_gather", ((1000,), (2000,))) in steps, steps
    assert ("paro:intra:all_gather", ((2000,), (4000,))) in steps, steps
    assert {name.split(":")[1] for name, _ in steps} == {"intra", "inter"}, steps
    print(f"rank {dist.get_rank()}: traced {len(events)} paro events")
    dist.destroy_process_group()


def desync() -> None:
    dist.init_process_group("paro", timeout=datetime.timedelta(seconds=5))
    rank = dist.get_rank()
    t = torch.ones(1000)
    dist.all_reduce(t)
    try:
        if rank == 1:
            dist.all_gather_into_tensor(torch.empty(1000 * dist.get_world_size()), t)
        else:
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        print(f"rank {rank}: {type(e).__name__}: {e}")
        os._exit(0)  # the group is broken: skip its teardown
    print(f"rank {rank}: no error")
    os._exit(1)


def monitored() -> None:
    dist.init_process_group("paro")
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(10))
    if rank == 1:  # never arrives; waits until the others have reported
        time.sleep(8)
        os._exit(0)
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))
    except RuntimeError as e:
        print(f"rank {rank}: {e}")
        os._exit(0)
    print(f"rank {rank}: passed the barrier")
    os._exit(1)


def stats() -> None:
    """The counters under TORCH_DISTRIBUTED_DEBUG=DETAIL, where torch wraps the backend in its checker."""
    dist.init_process_group("paro")
    dist.all_reduce(torch.ones(1000))
    got = paro_torch.comm_stats()
    # 2 x 2: the inter-group all-reduce of this rank's half of the 4000 bytes, 2(g-1)/g * S/m = 2000
    assert got.intra_ops >= 1 and got.inter_ops >= 1 and got.inter_bytes == 2000, got
    dist.destroy_process_group()


def main() -> None:
    {"trace": trace, "desync": desync, "monitored": monitored, "stats": stats}[sys.argv[1]]()


if __name__ == "__main__":
    main()
