"""Memory held, bytes sent and bytes copied out per step by ParoShardedModule equal the Rust cost model's numbers
exactly."""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from engine import ACCUM, BATCH, SEQ, VOCAB, Block, loss_fn, make
from torch.distributed.fsdp import MixedPrecisionPolicy

import paro_torch
from paro_torch import ParoShardedModule
from paro_torch._groups import build_groups


def estimate(model: ParoShardedModule, world: int, group_size: int, param_bytes: int) -> dict:
    request = {
        "model": {"blocks": model.cost_blocks},  # sizes and the engine's padded sizes per granularity
        "cluster": {
            "world": world,
            "group_size": group_size,
            "intra_bandwidth": 1e10,
            "inter_bandwidth": 1e9,
            "intra_latency": 0,
            "inter_latency": 0,
            "memory_bytes": 10**12,
        },  # fmt: skip
        "training": {"grad_accum": ACCUM, **model.precision.bytes()},
        "collectives": "hierarchical",
        "strategies": [model.strategy.code],
    }
    return json.loads(paro_torch._C.estimate(json.dumps(request)))["strategies"][0]


# How the engine runs a hierarchical call on both levels (the cost model's traffic.rs counts the same parts)
GLOBAL_PARTS = {
    "all_gather": [("all_gather", "inter"), ("all_gather", "intra")],
    "reduce_scatter": [("reduce_scatter", "intra"), ("reduce_scatter", "inter")],
    "all_reduce": [("reduce_scatter", "intra"), ("all_reduce", "inter"), ("all_gather", "intra")],
}


def engine_kinds(rows: list[dict]) -> set[str]:
    """The "<collective> <level>" keys of ``comm_seconds`` that the cost model's collective rows imply."""
    kinds = set()
    for row in rows:
        parts = GLOBAL_PARTS[row["op"]] if row["level"] == "global" else [(row["op"], row["level"])]
        kinds |= {f"{op} {level}" for op, level in parts if row[f"{level}_bytes"] > 0}
        if row["unpacked_bytes"] > 0:
            kinds.add("unpack local")
    return kinds


def step(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    g = torch.Generator().manual_seed(7)
    for j in range(ACCUM):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        if j < ACCUM - 1:
            with model.no_sync():
                (loss_fn(model, x) / ACCUM).backward()
        else:
            (loss_fn(model, x) / ACCUM).backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    variants = sys.argv[1].split(",")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = build_groups(backend="paro")  # paro sub-groups: their counters measure bytes per level
    for variant in variants:
        dtype = torch.bfloat16 if variant in ("bf16", "bf16model") else torch.float32
        # bf16model: a bfloat16 model without a policy (masters, gradients and states in bfloat16)
        policy = None if variant == "bf16model" else MixedPrecisionPolicy(param_dtype=dtype)
        for code in paro_torch.STRATEGIES:
            model = ParoShardedModule(make(variant if variant != "bf16" else "plain"), code,
                                      process_groups=(groups.intra, groups.inter), wrap_policy={Block},
                                      mixed_precision=policy)  # fmt: skip
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            step(model, opt, rank)  # warm-up: creates optimizer states
            # both sets of the engine's groups (gathers, reductions): the paro backend measures their bytes
            levels = [
                pg
                for gs in (model._engine.comms.gather_groups, model._engine.comms.reduce_groups)
                for pg in (gs.intra, gs.inter)
                if pg is not None
            ]
            for pg in levels:
                paro_torch.reset_comm_stats(pg)
            model.reset_comm_bytes()
            step(model, opt, rank)  # a steady-state step: its first forward syncs the previous update
            stats = [paro_torch.comm_stats(pg) for pg in levels]
            intra, inter = sum(s.intra_bytes for s in stats), sum(s.inter_bytes for s in stats)
            nominal = model.comm_bytes()
            assert (nominal["intra"], nominal["inter"]) == (intra, inter), (code, variant, nominal, intra, inter)
            want = estimate(model, world, groups.group_size, dtype.itemsize)
            timed = model.comm_seconds()  # the kinds of collective each level ran, as the model's rows say
            assert set(timed) == engine_kinds(want["collectives"]), (code, variant, timed, want["collectives"])
            assert all(s > 0 for s in timed.values()), (code, timed)
            mem = model.memory_stats(opt)
            got = (mem["params"], mem["grads"], mem["optimizer_states"], intra, inter, model.unpacked_bytes())
            expected = (want["memory"]["params"], want["memory"]["grads"], want["memory"]["optimizer_states"],
                        want["intra_bytes"], want["inter_bytes"], want["unpacked_bytes"])  # fmt: skip
            # torch.chunk gives rank 0 the largest chunk of every parameter: the cost model's figure is rank 0's
            if rank == 0:
                assert got == expected, f"{code} {variant}: measured {got} != cost model {expected}"
            else:
                assert got[:2] + got[3:] == expected[:2] + expected[3:] and got[2] <= expected[2], (code, got, expected)
            if rank == 0:
                print(f"{code} {variant}: params/grads/optim/intra/inter/unpacked = {got}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
