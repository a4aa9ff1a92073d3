"""Observability of ``paro`` collectives (issue #14, item 5).

``trace``: every collective is a torch.profiler event ``paro:<op>`` with its input shapes and sequence number, and
each plan step an event ``paro:<level>:<kind>`` with its sizes; the group's sequence number counts collectives.
``desync``: rank 1 issues a different collective than the others; every rank's error names its own collective and
sequence number (with TORCH_DISTRIBUTED_DEBUG=DETAIL, torch's checker names the mismatch before anything runs).
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import paro_torch  # noqa: F401


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
    assert group_seq(pg) == 2, group_seq(pg)
    events = [e for e in prof.events() if e.name.startswith("paro:")]
    ops = {e.name: e for e in events if e.name.count(":") == 1}
    assert set(ops) == {"paro:all_reduce", "paro:all_gather_into_tensor"}, sorted(ops)
    assert ops["paro:all_reduce"].input_shapes == [[1000], []], ops["paro:all_reduce"].input_shapes
    assert ops["paro:all_reduce"].concrete_inputs[1] == 1  # its sequence number
    assert ops["paro:all_gather_into_tensor"].concrete_inputs[1] == 2
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


if __name__ == "__main__":
    {"trace": trace, "desync": desync}[sys.argv[1]]()
