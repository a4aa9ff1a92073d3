"""strategy="auto": a bounded link probe, the cost model's choice on every rank, clear errors when nothing fits."""

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from engine import Block, make

import paro_torch
from paro_torch import ParoShardedModule
from paro_torch._groups import build_groups
from paro_torch.auto import LinkCalibration, estimate, measure_links, model_flops, overlaps_from_loops


def agree(code: str) -> None:
    """Asserts every rank chose the same strategy."""
    mine = torch.tensor([paro_torch.STRATEGIES.index(code)])
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    assert all(int(x) == int(mine) for x in everyone), everyone


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = build_groups()
    pgs = (groups.intra, groups.inter)

    # the probe through calibrate(): measure_links on these groups, and rank 0 saves the figures (read back below)
    path = os.path.join(tempfile.gettempdir(), f"paro-calibration-{os.environ['MASTER_PORT']}.json")
    start = time.perf_counter()
    links = paro_torch.calibrate(path, group_size=groups.group_size)
    probe = time.perf_counter() - start
    # links, MLP and AdamW steps (a window of at least 1 s each; the first AdamW step in a process loads the
    # optimizer's code: ~1 s) and the overlap of each level's gathers with compute (3 trials of three 0.1 s loops):
    # about 12 s for 4 ranks on 2 cores, 16-24 s when the machine runs slow (measured on 2026-12-07, idle): a bound
    # on the probe's design (it must not grow with the model), not a speed test
    assert probe < 30.0, f"the probe took {probe:.2f}s"
    intra, inter = links.intra, links.inter
    assert intra.bandwidth > 0 and inter.bandwidth > 0, links
    # the engine's own reduce-scatter, timed apart (on Gloo an all-to-all and a sum: not the all-gather's speed)
    assert intra.reduce_scatter_bandwidth and inter.reduce_scatter_bandwidth, links
    assert inter.all_reduce_bandwidth and inter.all_reduce_bandwidth > 0, links  # t_syncg's, apart
    assert intra.reduce_scatter_slowdown and intra.reduce_scatter_slowdown >= 1, links
    assert inter.reduce_scatter_slowdown and inter.reduce_scatter_slowdown >= 1, links
    assert links.compute_flops and links.compute_flops > 1e8 and links.optimizer_params_per_s, links
    figures = [intra.latency, inter.latency, intra.bandwidth, inter.bandwidth, links.compute_flops,
               links.optimizer_params_per_s, intra.reduce_scatter_bandwidth, inter.reduce_scatter_bandwidth,
               inter.all_reduce_bandwidth]  # fmt: skip
    # the overlap probe's loops are recorded (every level and collective) and give back its figures
    assert links.overlap_loops is not None and len(links.overlap_loops) == 4, links
    derived = overlaps_from_loops(links, groups)
    assert derived == links, (derived, links)
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, [figures, links.overlap_loops])
    assert all(e == [figures, links.overlap_loops] for e in every), f"the ranks' figures differ: {every}"
    # the probe's timings run the ranks in step: ranks whose runs take 5 ms read rank 0's 20 ms as well
    pace = paro_torch.auto._mean_seconds(lambda: time.sleep(0.02 if rank == 0 else 0.005), 3, dist.group.WORLD,
                                         torch.device("cpu"), min_s=0.2)  # fmt: skip
    assert pace >= 0.02, f"rank {rank} timed {pace:.4f} s per run: not in step with rank 0"

    # a generous budget: the cost model's fastest strategy, the same on every rank
    model = ParoShardedModule(make("plain"), "auto", process_groups=pgs, wrap_policy={Block}, memory_budget=10**9)
    assert model.plan is not None and model.strategy.code == model.plan["choice"]["code"]
    agree(model.strategy.code)

    # a budget that rules DDP (NNN) out
    need = {s["code"]: s["memory"]["total"] for s in model.plan["strategies"]}
    budget = (min(need.values()) + need["NNN"]) // 2
    tight = ParoShardedModule(make("plain"), "auto", process_groups=pgs, wrap_policy={Block}, memory_budget=budget,
                              calibration=links)  # fmt: skip
    assert need[tight.strategy.code] <= budget and need["NNN"] > budget, (tight.strategy.code, budget)
    agree(tight.strategy.code)

    # figures saved by calibrate() and read back through PARO_CALIBRATION give the same plan
    saved = links
    dist.barrier()
    assert LinkCalibration.load(path) == saved
    os.environ["PARO_CALIBRATION"] = path
    again = ParoShardedModule(make("plain"), "auto", process_groups=pgs, wrap_policy={Block}, memory_budget=budget)
    del os.environ["PARO_CALIBRATION"]
    direct = ParoShardedModule(make("plain"), "auto", process_groups=pgs, wrap_policy={Block}, memory_budget=budget,
                               calibration=saved)  # fmt: skip
    assert again.plan == direct.plan

    # an explicit strategy with a budget and link figures: its plan's times come from those figures, as auto's
    explicit = ParoShardedModule(make("plain"), "IIG", process_groups=pgs, wrap_policy={Block}, memory_budget=budget,
                                 calibration=saved)  # fmt: skip
    times = {s["code"]: s["time_s"] for s in direct.plan["strategies"]}
    assert explicit.plan is not None and explicit.plan["strategies"][0]["time_s"] == times["IIG"], explicit.plan

    # link figures alone plan an explicit strategy too (against the default budget), given or through PARO_CALIBRATION
    for env, kwargs in (({}, {"calibration": saved}), ({"PARO_CALIBRATION": path}, {})):
        os.environ.update(env)
        planned = ParoShardedModule(make("plain"), "IIG", process_groups=pgs, wrap_policy={Block}, **kwargs)
        os.environ.pop("PARO_CALIBRATION", None)
        assert planned.plan is not None and planned.plan["strategies"][0]["time_s"] == times["IIG"], planned.plan
    bare = ParoShardedModule(make("plain"), "IIG", process_groups=pgs, wrap_policy={Block})
    assert bare.plan is None and bare.links is None

    # with the tokens per micro-step, the predicted step includes compute (and the optimizer, always measured)
    timed = ParoShardedModule(make("plain"), "auto", process_groups=pgs, wrap_policy={Block}, memory_budget=budget,
                              calibration=saved, tokens_per_micro_step=64)  # fmt: skip
    assert timed.plan is not None and direct.plan is not None
    for with_compute, without in zip(timed.plan["strategies"], direct.plan["strategies"], strict=True):
        assert with_compute["step"]["compute_s"] > 0 and without["step"]["compute_s"] == 0, with_compute
        assert with_compute["step"]["optimizer_s"] > 0 and with_compute["step"]["step_s"] > without["step"]["step_s"]
    assert not any("compute_flops" in note for note in timed.plan["notes"]), timed.plan["notes"]
    # CPU ranks share their cores between compute and intra-group collectives: the plan says so to the cost model
    shared = estimate(timed.cost_blocks, groups, links=saved, memory_budget=budget, grad_accum=timed.plan["grad_accum"],
                      sizes=timed.precision.bytes(), tokens_per_micro_step=64, shared_cores=True)  # fmt: skip
    assert shared["strategies"] == timed.plan["strategies"]

    # the model's own forward and backward as the compute probe (example_inputs): its throughput is the cost
    # model's FLOPs for them (6 per parameter and token here: every parameter trains, no checkpointing) over the
    # time, and the optimizer's is AdamW's on its parameters' shapes; the probe leaves parameters, gradients,
    # buffers (BatchNorm's statistics) and random state as they were
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 8))
    x = torch.randn(32, 8)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    probed = ParoShardedModule(net, "auto", process_groups=pgs, wrap_policy={torch.nn.Linear}, memory_budget=budget,
                               calibration=saved, tokens_per_micro_step=32, example_inputs=x)  # fmt: skip
    assert torch.equal(torch.get_rng_state(), rng)
    assert probed.links is not None and probed.links.compute_probe == "model", probed.links
    assert probed.links.compute_flops and probed.links.compute_flops != saved.compute_flops, probed.links
    assert probed.links.optimizer_params_per_s != saved.optimizer_params_per_s, probed.links  # AdamW on its shapes
    assert model_flops(probed.cost_blocks, groups, 32) == 6 * sum(p.numel() for p in net.parameters()) * 32
    after = probed.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "the probe changed the model's state"
    assert all(p.grad is None for p in probed.parameters())
    rates = [0.0] * dist.get_world_size()
    dist.all_gather_object(rates, probed.links.compute_flops)
    assert len(set(rates)) == 1, rates  # every rank plans with the same figure (the ranks' mean)

    # a model whose unsharded step does not fit the budget is not timed (its parameters and gradients, whole:
    # 2 x 4 bytes each), and the stand-in figures plan a sharded strategy that fits
    wide = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])  # small units: small gather buffers
    whole = 8 * sum(p.numel() for p in wide.parameters())
    untimed = ParoShardedModule(wide, "auto", process_groups=pgs, wrap_policy={torch.nn.Linear},
                                memory_budget=whole - 1, calibration=saved, tokens_per_micro_step=32,
                                example_inputs=torch.randn(32, 64))  # fmt: skip
    assert untimed.links is not None and untimed.links.compute_probe == saved.compute_probe != "model", untimed.links

    # no calibration given: the links are measured, and the throughputs and overlaps only on the model (the
    # stand-in MLP and AdamW probes are not run at all)
    def no_stand_ins(*_: object, **__: object) -> None:
        raise AssertionError("the stand-in throughput probe ran although a model probe follows")

    stand_ins, paro_torch.auto.measure_throughputs = paro_torch.auto.measure_throughputs, no_stand_ins
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 8))
    only_model = ParoShardedModule(net, "auto", process_groups=pgs, wrap_policy={torch.nn.Linear},
                                   memory_budget=budget, tokens_per_micro_step=32, example_inputs=x)  # fmt: skip
    paro_torch.auto.measure_throughputs = stand_ins
    got = only_model.links
    assert got is not None and got.compute_probe == "model" and got.compute_flops, got
    assert got.optimizer_params_per_s and got.intra.overlap is not None and got.inter.overlap is not None, got
    assert got.intra.slowdown is not None and got.intra.slowdown >= 1 and got.inter.slowdown >= 1, got
    assert measure_links(groups, large=1 << 16, repeats=1, throughputs=False).compute_flops is None
    # each link figure is the median over rounds of the slowest rank's (the levels scripted: round r, rank k)
    levels_called: list[object] = []

    def scripted(pg: object, *_: object, all_reduce: bool = False) -> tuple[float, float, float, float | None]:
        r, level = len(levels_called) // 2, (1.0 if pg is groups.intra else 2.0)
        levels_called.append((pg, all_reduce))
        bandwidth = level * [300.0, 100.0, 200.0][r] + rank  # the lowest: rank 0's
        # latency: rank 0's highest; the all-reduce probed across groups only
        latency = level * [3.0, 1.0, 2.0][r] / (1 + rank)
        return bandwidth, latency, 10 * bandwidth, 20 * bandwidth if all_reduce else None

    real_level, paro_torch.auto._level = paro_torch.auto._level, scripted
    rounds = measure_links(groups, throughputs=False, rounds=3)
    paro_torch.auto._level = real_level
    assert levels_called == [(groups.intra, False), (groups.inter, True)] * 3, levels_called
    assert (rounds.intra.bandwidth, rounds.inter.bandwidth) == (200.0, 400.0), rounds
    assert (rounds.intra.latency, rounds.inter.latency) == (2.0, 4.0), rounds
    assert (rounds.intra.reduce_scatter_bandwidth, rounds.inter.reduce_scatter_bandwidth) == (2000.0, 4000.0)
    assert rounds.inter.all_reduce_bandwidth == 8000.0, rounds
    try:
        measure_links(groups, rounds=0)
    except ValueError as e:
        assert "rounds=0" in str(e), e
    else:
        raise AssertionError("rounds=0 was accepted")
    try:  # the batch's tokens are needed to count its FLOPs: an error on every rank
        ParoShardedModule(make("plain"), "auto", process_groups=pgs, wrap_policy={Block}, calibration=saved,
                          example_inputs=torch.zeros(2, 6, dtype=torch.long))  # fmt: skip
    except ValueError as e:
        assert "example_inputs needs tokens_per_micro_step" in str(e), e
    else:
        raise AssertionError("example_inputs without tokens_per_micro_step was accepted")

    # a root without parameters of its own (every parameter in a wrapped block)
    blocks = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    ParoShardedModule(blocks, "auto", process_groups=pgs, wrap_policy={torch.nn.Linear}, memory_budget=10**9,
                      calibration=links)  # fmt: skip

    # nothing fits / the requested strategy does not fit: an error on every rank, naming the fix
    for strategy, limit, message in [("auto", 1000, "found no strategy that fits"), ("ddp", budget, "needs")]:
        try:
            ParoShardedModule(make("plain"), strategy, process_groups=pgs, wrap_policy={Block}, memory_budget=limit,
                              calibration=links)  # fmt: skip
        except ValueError as e:
            assert message in str(e), e
        else:
            raise AssertionError(f"{strategy} with {limit} bytes was accepted")
    if rank == 0:
        print(f"auto OK: probe {probe * 1e3:.0f} ms, chose {model.strategy.code}, then {tight.strategy.code}")
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
