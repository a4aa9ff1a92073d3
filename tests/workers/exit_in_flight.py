"""Collectives still in flight on the engine's communicators when the interpreter exits (clean exits).

Gloo runs a collective on a thread of its own, which drops its reference to the tensors when the collective is done.
When Python dropped them first, that drop is the last one and takes the GIL; once the interpreter finalizes, a
thread that takes the GIL exits on the spot, inside a destructor, and the process aborts ("terminate called without
an active exception"). Here every rank issues async collectives on each of the engine's communicators, drops their
tensors and exits at once, holding the GIL (a long switch interval) so that Gloo's threads cannot finish before
the interpreter finalizes: paro_torch must have them done while it is still alive. An exit handler registered
before paro_torch's (so run after it) checks that the threads of paro_torch's Gloo communicators have joined.

Usage: exit_in_flight.py MODE; MODE in ``destroy`` (the script destroys the default group), ``keep`` (it does not)
and ``module`` (a wrapped model stays alive in a global, and the script destroys the default group).
"""

import atexit
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn


def gloo_threads() -> int:
    """This process's Gloo worker threads."""
    return sum((t / "comm").read_text().strip() == "pt_gloo_runloop" for t in Path("/proc/self/task").iterdir())


def check_threads() -> None:
    """After paro_torch's exit handler: the default group's threads (if the script did not destroy it) are left."""
    left = gloo_threads()
    if left != (world_threads if mode == "keep" else 0):
        print(f"{left} Gloo threads left at exit (the default group has {world_threads})", flush=True)
        os._exit(3)


mode = sys.argv[1]
atexit.register(check_threads)
from paro_torch import ParoShardedModule  # noqa: E402  (its exit handler runs before check_threads)

dist.init_process_group("gloo")
dist.barrier()
world_threads = gloo_threads()
model = ParoShardedModule(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), "IIG", group_size=2)
model(torch.randn(2, 4)).sum().backward()
comms, groups = model._engine.comms, model.groups
mesh_groups = [comms.mesh.get_group(d) for d in ("intra", "inter")]
ours = [groups.intra, groups.inter, comms.gather_world, *mesh_groups]
ours += [pg for gs in (comms.gather_groups, comms.reduce_groups) for pg in (gs.intra, gs.inter, gs.whole)]
if mode != "module":
    del model
sys.setswitchinterval(1000.0)  # this thread keeps the GIL until it blocks
for pg in ours:
    for _ in range(4):
        dist.all_reduce(torch.ones(256), group=pg, async_op=True)  # tensor and work dropped at once
del pg, ours, mesh_groups, comms, groups
if mode in ("destroy", "module"):
    dist.destroy_process_group()
print(f"rank {dist.get_rank() if dist.is_initialized() else '-'}: exiting", flush=True)
