"""The Rust core as Python sees it: strategies, topology errors, layout, plans."""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import paro_torch
from paro_torch import _C


def test_fourteen_strategies_and_aliases() -> None:
    assert len(paro_torch.STRATEGIES) == 14
    assert [s.code for s in paro_torch.Strategy.all()] == paro_torch.STRATEGIES
    pairs = [("ddp", "NNN"), ("zero1", "NNG"), ("zero2", "NGG"), ("zero3", "GGG"), ("fsdp", "GGG"), ("mics", "III")]
    pairs += [("hsdp", "III"), ("hsdp_zero2", "NII"), ("PaRO-IIG", "IIG"), ("iig", "IIG")]
    for alias, code in pairs:
        assert paro_torch.Strategy(alias).code == code
    s = paro_torch.Strategy("IIG")
    assert (s.p, s.g, s.os, s.known_as) == ("I", "I", "G", None)


@pytest.mark.parametrize("code,better", [("INN", "INI"), ("GGI", "GGG"), ("NGN", "NGG")])
def test_eliminated_strategies_name_what_dominates_them(code: str, better: str) -> None:
    with pytest.raises(paro_torch.InvalidStrategyError, match=f"{better} dominates"):
        paro_torch.Strategy(code)


def test_unknown_strategy_lists_the_aliases() -> None:
    with pytest.raises(ValueError, match="zero3=GGG"):
        paro_torch.Strategy("zero4")


def test_group_size_must_divide_world() -> None:
    with pytest.raises(paro_torch.TopologyError, match="world size 6 is not divisible by group size 4"):
        _C.check_topology(6, 4)


def test_nested_layout() -> None:
    # 9 rows of 3 on 2 x 2: I-chunks 5 + 4 rows, G-chunks 3, 2 | 2, 2 (block r*g + k), as DTensor shards them
    layout = _C.RowLayout([(9, 3, False), (1, 1, True)], 4, 2, "G")
    assert (layout.blocks, layout.block_numel, layout.padded) == (4, 10, 40)
    assert layout.places[0] == (0, 3, [(0, 3), (3, 2), (5, 2), (7, 2)])
    assert layout.range("I", 3) == (20, 40) and layout.range("G", 3) == (30, 40) and layout.range("N", 3) == (0, 40)
    assert _C.RowLayout([(10, 1, False)], 4, 2, "N").padded == 12  # one block, padded to a multiple of n


@pytest.mark.parametrize(("world", "group_size"), [(4, 2), (6, 3), (8, 2), (8, 4), (3, 1), (5, 5)])
def test_layout_chunks_are_dtensor_shards(world: int, group_size: int) -> None:
    """Each block's rows are exactly the local shard DTensor computes for its rank on the (intra, inter) mesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    g = world // group_size
    for granularity, placements in (("I", (Shard(0), Replicate())), ("G", (Shard(0), Shard(0)))):
        for rows in range(0, 3 * world + 2):
            layout = _C.RowLayout([(rows, 2, False)], world, group_size, granularity)
            for r in range(group_size):
                for k in range(g):
                    block = r if granularity == "I" else r * g + k
                    shape, offset = _compute_local_shape_and_global_offset(
                        (rows, 2), (group_size, g), [r, k], placements
                    )
                    start, count = layout.places[0][2][block]
                    assert count == shape[0] and (count == 0 or start == offset[0]), (granularity, rows, r, k)


def test_subgroup_shapes() -> None:
    assert _C.subgroup_shape([0, 1, 2, 3], 2) == ((4, 2), None)
    assert _C.subgroup_shape([1, 3], 2) == ((2, 1), None)
    shape, why = _C.subgroup_shape([0, 1, 2], 2)
    assert shape is None and "same number" in why


def test_plan_bytes_for_a_ring_all_gather() -> None:
    # S = 8 ranks x 16 elements x 4 bytes; inter (g-1)/g*S/m, intra (m-1)/m*S per rank
    plan = json.loads(_C.describe_plan("all_gather", 8, 4, 5, 16))
    inter = sum(s["bytes"] for s in plan["steps"] if s["level"] == "inter")
    intra = sum(s["bytes"] for s in plan["steps"] if s["level"] == "intra")
    s = 8 * 16 * 4
    assert (inter, intra) == (s // 2 // 4, 3 * s // 4)


@pytest.mark.parametrize(
    "loops,alone,slowdown,fraction",
    [
        # the gathers (1 s alone) took 2 s beside compute, which ran 3 steps of 1 s in 3.5 s: it lost 0.5 s to them
        ((1.0, 1.0, 2.0, 3, 3.5), None, 2.0, 0.5),
        # no effect either way
        ((0.5, 1.0, 1.0, 2, 1.0), None, 1.0, 1.0),
        # priced by the calibration at 0.25 s (the probe's own loop alone read 0.5 s): the product of the slowdown
        # and that price is the 1 s the gathers took beside compute; compute lost 0.1 s over their 0.25 s of work
        ((0.1, 0.5, 1.0, 11, 1.2), 0.25, 4.0, 0.6),
    ],
)
def test_overlap_probe_gives_the_cost_models_rate_model(
    loops: tuple[float, float, float, int, float], alone: float | None, slowdown: float, fraction: float
) -> None:
    """The probe's loops give the figures of the rate model of rust/paro-core/src/cost/schedule.rs: collectives at
    1 / slowdown beside compute, compute losing 1 - fraction per second of their work."""
    from paro_torch.auto import OverlapLoops

    got = OverlapLoops(*loops, calls=1, nbytes=1).rates(alone)
    assert got.slowdown == pytest.approx(slowdown, abs=1e-12)
    assert got.fraction == pytest.approx(fraction, abs=1e-12)
    assert got.slowdown * (alone or loops[1]) == pytest.approx(loops[2], abs=1e-12)  # the gathers' time beside


def test_overlap_probe_follows_the_rate_model_through_a_step_that_outlasts_the_collectives() -> None:
    """Gathers of 1 s alone at slowdown 2 beside compute that loses 0.5 s per second of their work (fraction 0.5,
    0.75 of its speed): steps of 1 s alone, the first ends at 4/3 s, the second has 0.5 s of work done when the
    gathers end at 2 s and runs its last 0.5 s alone, to 2.5 s."""
    from paro_torch.auto import OverlapLoops

    got = OverlapLoops(step=1.0, collectives=1.0, collectives_beside=2.0, steps_beside=2, compute_beside=2.5,
                       calls=1, nbytes=1).rates()  # fmt: skip
    assert (got.slowdown, got.fraction) == (2.0, 0.5)


def test_overlap_loops_are_priced_as_the_cost_model_prices_a_ring() -> None:
    """Three all-gathers of 4 KiB over 4 ranks: each 3 ring steps of latency and 3/4 of the bytes received."""
    from paro_torch.auto import OverlapLoops

    loops = OverlapLoops(1.0, 1.0, 1.0, 1, 1.0, calls=3, nbytes=4096)
    assert loops.alone_seconds(4, bandwidth=1024.0, latency=0.01) == pytest.approx(3 * (3 * 0.01 + 3.0), abs=1e-12)


def test_a_levels_overlap_comes_from_all_its_loops_together() -> None:
    """Compute lost beside the gathers and the reduce-scatters of a level, over their work (2 x 2, one ring step)."""
    import types

    from paro_torch import auto

    gather = [0.1, 0.5, 1.0, 10, 1.02, 50, 4 << 20]  # step, alone, beside, steps beside, their seconds, calls, nbytes
    scatter = [0.1, 0.5, 1.0, 10, 1.06, 50, 4 << 20]  # 0.02 s and 0.06 s of compute lost
    loops = {f"{level}_{op}": gather if op == "all_gather" else scatter for level in ("intra", "inter")
             for op in ("all_gather", "reduce_scatter")}  # fmt: skip
    links = auto.LinkCalibration(auto.Link(1e9, 1e-3), auto.Link(1e8, 2e-3), overlap_loops=loops)
    got = auto.overlaps_from_loops(links, types.SimpleNamespace(group_size=2, num_groups=2))  # type: ignore[arg-type]
    intra_work = 2 * 50 * (1e-3 + (2 << 20) / 1e9)
    assert got.intra.overlap == pytest.approx(1 - 0.08 / intra_work)  # the gathers' alone: 1 - 0.02 / (work / 2)
    assert got.intra.slowdown == pytest.approx(1.0 / (intra_work / 2))


def test_link_figures_are_saved_as_one_flat_record(tmp_path: Path) -> None:
    """One ``Link`` per level in Python; saved (and sent to the cost model) as ``<level>_<figure>`` keys."""
    from paro_torch.auto import LinkCalibration

    recorded = json.loads((Path(__file__).parent / "data" / "training-2x2-1gbit-rec.json").read_text())
    saved = recorded["calibration"]["links"]  # as calibrate() wrote it
    links = LinkCalibration.from_record(saved)
    assert links.inter.all_reduce_bandwidth == saved["inter_all_reduce_bandwidth"]
    assert links.intra.reduce_scatter_slowdown == saved["intra_reduce_scatter_slowdown"]
    assert list(links.to_record().items()) == list(saved.items())
    links.save(tmp_path / "links.json")
    assert (tmp_path / "links.json").read_text() == json.dumps(saved, indent=2) + "\n"
    assert LinkCalibration.load(tmp_path / "links.json") == links
    assert links.replace_figures(inter_slowdown=2.0).inter.slowdown == 2.0
    with pytest.raises(TypeError, match="lack inter_latency"):
        LinkCalibration.from_record({k: v for k, v in saved.items() if k != "inter_latency"})


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    """A Gloo default group of this process alone, destroyed on exit."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("loop_steps", [1, 3])
def test_overlap_probe_loops_hold_at_least_loop_steps_model_steps(loop_steps: int) -> None:
    """A 10 ms step against a 1 ms loop: each compute loop runs ``loop_steps`` steps (one warm-up step before)."""
    import time

    import torch
    import torch.distributed as dist

    from paro_torch import auto

    calls = {"n": 0}

    def step() -> None:
        calls["n"] += 1
        time.sleep(0.01)

    with _one_rank_group():
        got = auto.measure_overlap(torch.device("cpu"), dist.group.WORLD, step=step, loop_s=0.001, trials=1,
                                   loop_steps=loop_steps)  # fmt: skip
    assert calls["n"] - got.steps_beside == 1 + loop_steps


def test_overlap_probe_raises_what_its_collectives_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective that fails on the probe's thread (a peer died) ends the probe with that error on the caller."""
    import torch
    import torch.distributed as dist

    from paro_torch import auto

    calls = {"n": 0}

    def failing(*_: object) -> object:
        def call() -> None:
            calls["n"] += 1
            if calls["n"] > 2:  # after the warm-up loops that size the probe
                raise RuntimeError("peer died")

        return call

    monkeypatch.setattr(auto, "_collective", failing)
    with _one_rank_group(), pytest.raises(RuntimeError, match="peer died"):
        auto.measure_overlap(torch.device("cpu"), dist.group.WORLD, step=lambda: None, loop_s=0.001, trials=1)


def test_model_probe_takes_its_two_in_step_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compute: the mean of the step's timings before and after the overlap probe; the loops' free timings do not
    count."""
    import dataclasses

    import torch

    from paro_torch import auto
    from paro_torch._groups import build_groups

    def loops(links: auto.LinkCalibration, *_: object, **__: object) -> auto.LinkCalibration:
        steps = {"intra_all_gather": 0.1, "intra_reduce_scatter": 0.12, "inter_all_gather": 0.11,
                 "inter_reduce_scatter": 0.0}  # fmt: skip  # 0: a level of one rank, nothing timed
        return dataclasses.replace(links, overlap_loops={k: [v, 0, 0, 0, 0, 0, 0] for k, v in steps.items()})

    timings = iter([0.2, 0.3, 2.0])  # the step before the loops, after them; AdamW (per parameter: 2.0 / 6)
    monkeypatch.setattr(auto, "_overlaps", loops)
    monkeypatch.setattr(auto, "_mean_seconds", lambda *_, **__: next(timings))
    links = auto.LinkCalibration(auto.Link(1e9, 0.0), auto.Link(1e9, 0.0))
    with _one_rank_group():
        got = auto.probe_model(links, build_groups(1), torch.nn.Linear(2, 2), torch.ones(1, 2), flops=1e9,
                               device=torch.device("cpu"))  # fmt: skip
    assert got.compute_flops == pytest.approx(1e9 / 0.25)
    assert got.optimizer_params_per_s == pytest.approx(6 / 2.0)


def test_copy_out_probe_regrows_copies_and_frees_like_the_unshard(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's step re-grows a freed storage, copies into it and frees it; its speed is bytes over seconds."""
    import torch

    from paro_torch import auto
    from paro_torch._groups import build_groups

    grown = []
    resize = torch.UntypedStorage.resize_

    def spy(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        grown.append(size)
        return resize(storage, size)

    step, copied = auto._unpack_step(4096, torch.device("cpu"), copies=3)
    assert copied == 3 * 4096
    monkeypatch.setattr(torch.UntypedStorage, "resize_", spy)
    step()
    assert grown == [4096, 0] * 3
    monkeypatch.setattr(auto, "_mean_seconds", lambda *_, **__: 0.5)
    with _one_rank_group():
        speed = auto.measure_unpack(build_groups(1), nbytes=1 << 20, copies=4)
    assert speed == pytest.approx(4 * (1 << 20) / 0.5)


def test_the_backend_takes_its_link_figures_from_a_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk count's link figures (docs/backend.md, "Settings"): from the option, else PARO_CALIBRATION."""
    from paro_torch._backend import _links

    cal = paro_torch.LinkCalibration(paro_torch.auto.Link(1e9, 1e-5), paro_torch.auto.Link(12.5e6, 1e-4))
    assert _links(cal) == [1e9, 1e-5, 12.5e6, 1e-4]
    monkeypatch.delenv("PARO_CALIBRATION", raising=False)
    assert _links(None) is None
    cal.save(tmp_path / "links.json")
    monkeypatch.setenv("PARO_CALIBRATION", str(tmp_path / "links.json"))
    assert _links(None) == [1e9, 1e-5, 12.5e6, 1e-4]
