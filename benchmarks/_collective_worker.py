"""One rank of benchmarks/collectives.py: times collectives and reads its node's link counters.

Started by torchrun (one torchrun per emulated node, or one on localhost). For each op and size it runs one checked
call, warm-up calls and R timed calls (a barrier on a separate Gloo group before each), and local rank 0 of every
node reads rx/tx of the node's interface (GLOO_SOCKET_IFNAME) and of ``lo`` from /proc/net/dev before and after the
timed section. /proc/net/dev is per network namespace, so inside a testbed node it shows exactly that node's link.
Global rank 0 prints one ``PAROBENCH <json>`` line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _testbed import emit, read_netdev

import paro_torch

OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
ELEM = 4  # float32


class Case:
    """Buffers and the call for one (op, size): ``run()`` issues the collective, ``check()`` verifies it."""

    def __init__(self, op: str, size: int, rank: int, world: int) -> None:
        self.op, self.size, self.rank, self.world = op, size, rank, world
        n = size // ELEM
        self.n = n
        if op == "all_gather_into_tensor":
            self.inp = torch.full((n // world,), float(rank))
            self.out = torch.empty(n)
        elif op == "reduce_scatter_tensor":
            self.inp = torch.ones(n)
            self.out = torch.empty(n // world)
        elif op == "all_reduce":
            self.inp = self.out = torch.ones(n)
        else:
            raise ValueError(f"unknown op {op!r}")

    def reset(self) -> None:
        """Refills the in-place all-reduce buffer (outside the timed region) so values stay finite."""
        if self.op == "all_reduce":
            self.inp.fill_(1.0)

    def run(self) -> None:
        """Issues the collective once."""
        if self.op == "all_gather_into_tensor":
            dist.all_gather_into_tensor(self.out, self.inp)
        elif self.op == "reduce_scatter_tensor":
            dist.reduce_scatter_tensor(self.out, self.inp)
        else:
            dist.all_reduce(self.inp)

    def check(self) -> None:
        """Raises if the last result is wrong (inputs as set by __init__/reset)."""
        if self.op == "all_gather_into_tensor":
            want = torch.arange(self.world, dtype=torch.float32).repeat_interleave(self.n // self.world)
        else:
            want = torch.full_like(self.out, float(self.world))
        if not torch.equal(self.out, want):
            raise AssertionError(f"{self.op} of {self.size} bytes: wrong result on rank {self.rank}")


def timed_section(
    fn: Callable[[], None] | None,
    reset: Callable[[], None],
    repeats: int,
    bar: dist.ProcessGroup,
    counter_ifaces: list[str] | None,
    paro_group: bool,
) -> tuple[list[float], dict[str, dict[str, int]] | None, tuple[int, int] | None]:
    """R x (barrier, time fn); returns per-repeat ms, counter deltas (local rank 0) and paro (intra, inter) bytes.

    ``fn=None`` runs the same barriers without a collective: it measures what the barriers themselves add.
    """
    dist.barrier(group=bar)
    if paro_group:
        paro_torch.reset_comm_stats()
    before = read_netdev(counter_ifaces) if counter_ifaces else None
    times = []
    for _ in range(repeats):
        reset()
        dist.barrier(group=bar)
        t0 = time.perf_counter()
        if fn is not None:
            fn()
        times.append((time.perf_counter() - t0) * 1e3)
    dist.barrier(group=bar)
    delta = None
    if counter_ifaces:
        after = read_netdev(counter_ifaces)
        delta = {i: {k: after[i][k] - before[i][k] for k in ("rx", "tx")} for i in after if i in (before or {})}
    dist.barrier(group=bar)  # nobody's gather traffic below may reach a node that has not read its counters yet
    stats = None
    if paro_group:
        st = paro_torch.comm_stats()
        stats = (st.intra_bytes, st.inter_bytes)
    return times, delta, stats


def main() -> None:
    """Runs the cases described by ``--bench-config`` and prints the results on global rank 0."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-config", required=True, help="JSON file written by collectives.py")
    cfg = json.loads(open(ap.parse_args().bench_config).read())
    torch.set_num_threads(1)
    dist.init_process_group(cfg["backend"], timeout=timedelta(seconds=cfg.get("timeout_s", 300)))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    node = int(os.environ.get("GROUP_RANK", "0"))
    bar = dist.new_group(backend="gloo")  # barriers and result gathering stay off the measured backend
    is_paro = cfg["backend"] == "paro"
    iface = cfg.get("iface") or os.environ.get("GLOO_SOCKET_IFNAME") or "lo"
    ifaces = sorted({iface, "lo"})
    counter_ifaces = ifaces if local_rank == 0 else None
    repeats, warmup = int(cfg["repeats"]), max(0, int(cfg["warmup"]))

    def gathered(obj: Any) -> list[Any]:
        objs: list[Any] = [None] * world
        dist.all_gather_object(objs, obj, group=bar)
        return objs

    if rank == 0:
        emit(
            "meta",
            variant=cfg["variant"],
            backend=cfg["backend"],
            world=world,
            env={k: v for k, v in os.environ.items() if k.startswith(("PARO_", "GLOO_", "OMP_"))},
        )

    # What the barriers around a timed section add to the counters, measured with no collective at all.
    _, delta, _ = timed_section(None, lambda: None, repeats, bar, counter_ifaces, False)
    overhead = [d for d in gathered({"node": node, "delta": delta}) if d["delta"] is not None]
    if rank == 0:
        emit("overhead", variant=cfg["variant"], repeats=repeats, nodes=overhead)

    for op in cfg["ops"]:
        for size in cfg["sizes"]:
            case = Case(op, int(size), rank, world)
            case.run()
            case.check()
            for _ in range(warmup):
                case.reset()
                case.run()
            times, delta, stats = timed_section(case.run, case.reset, repeats, bar, counter_ifaces, is_paro)
            rows = gathered({"rank": rank, "node": node, "times_ms": times, "delta": delta, "paro": stats})
            if rank == 0:
                per_rank_median = [statistics.median(r["times_ms"]) for r in rows]
                per_repeat_max = [max(r["times_ms"][i] for r in rows) for i in range(repeats)]
                emit(
                    "case",
                    variant=cfg["variant"],
                    op=op,
                    size=int(size),
                    repeats=repeats,
                    median_ms=max(per_rank_median),
                    median_ms_per_rank=per_rank_median,
                    median_of_repeat_max_ms=statistics.median(per_repeat_max),
                    times_ms=[r["times_ms"] for r in rows],
                    nodes=[{"node": r["node"], "delta": r["delta"]} for r in rows if r["delta"] is not None],
                    paro_intra_bytes=sum(r["paro"][0] for r in rows) if is_paro else None,
                    paro_inter_bytes=sum(r["paro"][1] for r in rows) if is_paro else None,
                )
            del case
    dist.barrier(group=bar)
    if rank == 0:
        emit("done", variant=cfg["variant"])
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # make the failing rank obvious in the node's log
        print(f"[rank {os.environ.get('RANK', '?')}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
