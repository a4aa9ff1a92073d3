"""Where the `paro` backend's time goes on the emulated cluster (benchmarks/README.md, "Collectives").

As root: sets up the testbed (K nodes of M ranks, RATE), launches one torchrun per node running this file as the
worker, and prints, per case, the median over --repeats calls of each call's time (the max over ranks), every
call's time, and the TCP segments retransmitted and retransmission timeouts over both nodes during the calls:

- `rail-ag-both` / `rail-ag-one`: a plain Gloo all-gather on the inter-group sub-groups (one per rail) of
  S/(K*M) bytes per rank, on every rail at once / on rail 0 only: what the node's link carries in the time;
- `paro-ag-cC`, `paro-rs-cC`, `paro-ar-cC`: the `paro` backend's all_gather_into_tensor, reduce_scatter_tensor
  and all_reduce of S bytes with at most C chunks (PARO_MAX_CHUNKS; PARO_CHUNK_BYTES as set outside).

    python3 benchmarks/investigations/cc-link-bound/probe.py --nodes 2 --per-node 2 --rate 200mbit --size 16MiB
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2]  # benchmarks/
sys.path.insert(0, str(BENCH))


def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    import paro_torch

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = int(os.environ["PARO_GROUP_SIZE"])
    k = world // m
    sync = dist.new_group(backend="gloo")
    rails = [dist.new_group([g * m + r for g in range(k)], backend="gloo") for r in range(m)]
    my_rail = rails[rank % m]
    size = cfg["size"]
    n = size // 4

    def tcp() -> torch.Tensor:
        """This node's TCP retransmitted segments and retransmission timeouts (per network namespace)."""
        if rank % m:
            return torch.zeros(2)
        snmp = [line.split() for line in open("/proc/net/snmp") if line.startswith("Tcp:")]
        ext = [line.split() for line in open("/proc/net/netstat") if line.startswith("TcpExt:")]
        retrans = float(snmp[1][snmp[0].index("RetransSegs")])
        timeouts = float(ext[1][ext[0].index("TCPTimeouts")])
        return torch.tensor([retrans, timeouts])

    def timed(fn, reps: int) -> str:
        for _ in range(cfg["warmup"]):
            dist.barrier(group=sync)
            fn()
        ts = []
        before = tcp()
        for _ in range(reps):
            dist.barrier(group=sync)
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        delta = tcp() - before
        dist.all_reduce(delta, group=sync)
        all_ts = [torch.zeros(reps) for _ in range(world)]
        dist.all_gather(all_ts, torch.tensor(ts), group=sync)
        per_call = torch.stack(all_ts).max(dim=0).values.tolist()
        calls = " ".join(f"{x:6.0f}" for x in per_call)
        return f"{statistics.median(per_call):7.1f} ms  calls {calls}  retrans {delta[0]:.0f} timeouts {delta[1]:.0f}"

    out: dict[str, str] = {}
    blk = torch.ones(n // world)
    gathered = torch.empty(k * (n // world))
    out["rail-ag-both"] = timed(lambda: dist.all_gather_into_tensor(gathered, blk, group=my_rail), cfg["repeats"])

    def one_rail() -> None:
        if rank % m == 0:
            dist.all_gather_into_tensor(gathered, blk, group=rails[0])

    out["rail-ag-one"] = timed(one_rail, cfg["repeats"])
    for c in cfg["chunks"]:
        pg = dist.new_group(backend="paro", pg_options=paro_torch.ParoBackendOptions(max_chunks=c))
        inp, agout = torch.ones(n // world), torch.empty(n)
        if "ag" in cfg["ops"]:
            out[f"paro-ag-c{c}"] = timed(partial(dist.all_gather_into_tensor, agout, inp, group=pg), cfg["repeats"])
        rsin, rsout = torch.ones(n), torch.empty(n // world)
        if "rs" in cfg["ops"]:
            out[f"paro-rs-c{c}"] = timed(partial(dist.reduce_scatter_tensor, rsout, rsin, group=pg), cfg["repeats"])
        ar = torch.ones(n)
        if "ar" in cfg["ops"]:
            out[f"paro-ar-c{c}"] = timed(partial(dist.all_reduce, ar, group=pg), cfg["repeats"])
    if rank == 0:
        from _testbed import emit

        emit("probe", times=out)
        emit("done")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--size", default="16MiB")
    ap.add_argument("--chunks", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ops", default="ag,rs,ar", help="paro ops to time: ag, rs, ar")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return
    from _testbed import Testbed, base_env, run_launch, torchrun_commands
    from collectives import parse_size

    cfg = {
        "size": parse_size(args.size),
        "chunks": [int(c) for c in args.chunks.split(",")],
        "repeats": args.repeats,
        "warmup": args.warmup,
        "ops": args.ops.split(","),
    }
    logdir = BENCH / "results" / "raw" / "cc-link-bound"
    logdir.mkdir(parents=True, exist_ok=True)
    cfg_path = logdir / "probe.config.json"
    cfg_path.write_text(json.dumps(cfg))
    with Testbed(args.nodes, args.rate):
        cmds = torchrun_commands(
            args.nodes, args.per_node, [__file__, "--worker", str(cfg_path)], base_env(args.per_node), 29730, False
        )
        recs = run_launch("probe", cmds, logdir, 900)
    for r in recs:
        if r["kind"] == "probe":
            for key, line in r["times"].items():
                print(f"{key:16s} {line}")


if __name__ == "__main__":
    main()
