"""``strategy="auto"``: measure the links and the rank, ask the Rust cost model, agree on one strategy on every rank.

The probe times all-gathers of two sizes (4 KiB and 16 MiB: large enough that a link's burst allowance and
scheduling jitter do not inflate the bandwidth) on the intra-group and the inter-group communicator: the small one
gives the latency per ring step, the difference gives the bandwidth. It also times an MLP block's forward and
backward (the rank's compute throughput) and an AdamW step (the optimizer's), on all ranks at once, as they run in
training, and how much compute slows while each level's collectives run beside it. Given the model and an example
batch (``ParoShardedModule(example_inputs=...)``), the throughputs and overlaps are the model's own instead
(``probe_model``): its forward and backward timed on every rank at once (the cost model's FLOPs for them over the
seconds), beside each level's gathers, and AdamW on its shapes. Rank 0 decides; every rank uses its decision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from paro_torch import _C
from paro_torch._engine.collectives import Ledger, reduce_scatter
from paro_torch._groups import ParoGroups, build_groups

logger = logging.getLogger("paro_torch")

_NO_LINK = 1e15  # bandwidth of a level that has a single rank (nothing crosses it)


@dataclass(frozen=True)
class Link:
    """Measured figures of one level's links (the intra-group or the inter-group communicator), per rank."""

    bandwidth: float
    """All-gather bandwidth, bytes/s."""
    latency: float
    """Seconds per ring step."""
    overlap: float | None = None
    """How well compute runs beside this level's collectives, 0 to 1 (None: not measured, taken as 1: unslowed);
    see ``Overlap``."""
    slowdown: float | None = None
    """How much slower this level's collectives run beside compute, at least 1 (None: not measured, taken as 1)."""
    reduce_scatter_bandwidth: float | None = None
    """Bandwidth of the engine's reduce-scatter (on Gloo an all-to-all and a local sum), bytes/s (None: not
    measured, taken as ``bandwidth``)."""
    reduce_scatter_slowdown: float | None = None
    """How much slower reduce-scatters run beside compute (None: not measured, taken as ``slowdown``)."""
    all_reduce_bandwidth: float | None = None
    """Bandwidth of an all-reduce, bytes/s of the ring's 2(k - 1)/k of the buffer (None: not measured, taken as
    ``bandwidth``). Measured and priced across groups only: the engine's one large all-reduce is t_syncg's with
    g = N, I and os = N, I."""


_LEVELS = ("intra", "inter")
# The saved form's keys in the order ``save`` has always written them; a level's figure is "<level>_<figure>".
_RECORD_KEYS = (
    "intra_bandwidth", "inter_bandwidth", "intra_latency", "inter_latency", "compute_flops", "compute_probe",
    "optimizer_params_per_s", "intra_overlap", "inter_overlap", "intra_slowdown", "inter_slowdown",
    "intra_reduce_scatter_bandwidth", "inter_reduce_scatter_bandwidth", "inter_all_reduce_bandwidth",
    "intra_reduce_scatter_slowdown", "inter_reduce_scatter_slowdown", "unpack_bandwidth", "overlap_loops",
)  # fmt: skip


@dataclass(frozen=True)
class LinkCalibration:
    """Measured figures of both levels' links (one ``Link`` each) and the rank's throughputs.

    Saved (``save``, ``to_record``) as one flat JSON object whose level figures carry their level as a prefix
    (``intra_bandwidth``, ``inter_latency``, ...), as the cost model's request names them.
    """

    intra: Link
    """The intra-group links."""
    inter: Link
    """The inter-group links."""
    compute_flops: float | None = None
    """Training throughput of one rank, FLOP/s as the cost model counts FLOPs (None: not measured)."""
    compute_probe: str | None = None
    """What the throughputs timed: "mlp block" (the stand-ins) or "model" (the model's own step, its shapes)."""
    optimizer_params_per_s: float | None = None
    """Parameters an AdamW step updates per second on one rank (None: not measured)."""
    unpack_bandwidth: float | None = None
    """Bytes per second at which a rank copies gathered parameters out into storage it re-grows for them, as the
    engine's unshard does (None: not measured, the copy-out not counted)."""
    overlap_loops: dict[str, list[float]] | None = None
    """The overlap probe's timings the overlap figures come from, by level and collective ("intra_all_gather", ...):
    ``OverlapLoops``' fields, the ranks' median of each (None: not measured)."""

    def level(self, name: str) -> Link:
        """The links of level ``name``: "intra" or "inter"."""
        if name not in _LEVELS:
            raise ValueError(f"level {name!r}: use 'intra' or 'inter'")
        return self.intra if name == "intra" else self.inter

    @staticmethod
    def record_keys() -> tuple[str, ...]:
        """The keys of the saved form (``to_record``), in order."""
        return _RECORD_KEYS

    def to_record(self) -> dict[str, Any]:
        """The figures as one flat JSON-able dict, as ``save`` writes them (a level's figures as "<level>_<name>")."""
        record: dict[str, Any] = {}
        for key in _RECORD_KEYS:
            level, _, figure = key.partition("_")
            record[key] = getattr(self.level(level), figure) if level in _LEVELS else getattr(self, key)
        if self.intra.all_reduce_bandwidth is not None:  # never measured: the saved form had no key for it
            record["intra_all_reduce_bandwidth"] = self.intra.all_reduce_bandwidth
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> LinkCalibration:
        """Reads ``to_record``'s dict; figures it lacks are None (the bandwidths and latencies are required).

        Raises:
            TypeError: a key that names no figure, or a missing bandwidth or latency.
        """
        if not isinstance(record, dict):
            raise TypeError(f"link figures must be a JSON object, not {type(record).__name__}")
        levels: dict[str, dict[str, Any]] = {level: {} for level in _LEVELS}
        rest: dict[str, Any] = {}
        link_figures = {f.name for f in dataclasses.fields(Link)}
        for key, value in record.items():
            level, _, figure = key.partition("_")
            if level in _LEVELS and figure in link_figures:
                levels[level][figure] = value
            else:
                rest[key] = value
        missing = [f"{level}_{figure}" for level in _LEVELS for figure in ("bandwidth", "latency")
                   if figure not in levels[level]]  # fmt: skip
        if missing:
            raise TypeError(f"link figures lack {', '.join(missing)}")
        return cls(Link(**levels["intra"]), Link(**levels["inter"]), **rest)

    def replace_figures(self, **figures: Any) -> LinkCalibration:
        """A copy with the named figures replaced, named as in the saved form (e.g. ``intra_slowdown=6``)."""
        return type(self).from_record({**self.to_record(), **figures})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the figures as JSON (reuse them with ``PARO_CALIBRATION=path``)."""
        Path(path).write_text(json.dumps(self.to_record(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LinkCalibration:
        """Reads figures written by ``save``."""
        try:
            return cls.from_record(json.loads(Path(path).read_text()))
        except (OSError, TypeError, ValueError) as e:
            raise ValueError(f"cannot read link calibration {path}: {e}; rerun paro_torch.calibrate()") from e


def _sync(device: torch.device) -> Any:
    """A function that waits for the work queued on the calling thread's current stream (nothing on the CPU).

    The current stream's, not the whole device's: the overlap probe's compute must not wait for its collectives.
    """
    return (lambda: torch.cuda.current_stream(device).synchronize()) if device.type == "cuda" else (lambda: None)


def _gather_buffers(pg: dist.ProcessGroup, nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) float32 buffers of an all-gather over ``pg`` whose output holds about ``nbytes``."""
    x = torch.zeros(max(nbytes // (4 * dist.get_world_size(pg)), 1), device=device)
    return x, torch.empty(x.numel() * dist.get_world_size(pg), device=device)


def _collective(op: str, pg: dist.ProcessGroup, nbytes: int, device: torch.device) -> Callable[[], None]:
    """One call of the engine's ``op`` over ``pg``: "all_gather", "reduce_scatter" or "all_reduce".

    On about ``nbytes`` (the gather's output, the others' input): each rank sends (k - 1)/k of it, twice in an
    all-reduce.
    """
    x, out = _gather_buffers(pg, nbytes, device)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, x, group=pg)
    if op == "all_reduce":
        return lambda: dist.all_reduce(out, group=pg)
    ledger = Ledger()  # thrown away: the probe times the call itself
    return lambda: reduce_scatter(out, pg, ledger, "inter")


def _time_collective(op: str, pg: dist.ProcessGroup, nbytes: int, repeats: int, device: torch.device) -> float:
    call = _collective(op, pg, nbytes, device)
    sync = _sync(device)
    for _ in range(2):  # warm-up: connections, allocations, first touch of the buffers
        call()
    times = []
    for _ in range(repeats):
        dist.barrier(group=pg)
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _level(
    pg: dist.ProcessGroup | None, small: int, large: int, repeats: int, device: torch.device, all_reduce: bool = False
) -> tuple[float, float, float, float | None]:
    """(bandwidth, latency, reduce-scatter bandwidth, all-reduce bandwidth) of one level.

    From two all-gather sizes, and a reduce-scatter of the larger one (its latency taken as the small gather's);
    with ``all_reduce``, an all-reduce of the larger one too (its latency twice the small gather's; else None). The
    engine's only large all-reduce is the inter-group one of t_syncg: on the emulated cluster's Gloo it moves its
    bytes 1.12-1.23x as fast as an all-gather (benchmarks/JOURNAL.md, "The all-reduce across groups").
    """
    if pg is None:
        return _NO_LINK, 0.0, _NO_LINK, _NO_LINK if all_reduce else None
    k = dist.get_world_size(pg)
    t_small = _time_collective("all_gather", pg, small, repeats, device)
    t_large = _time_collective("all_gather", pg, large, repeats, device)
    t_scatter = _time_collective("reduce_scatter", pg, large, repeats, device)
    steps = k - 1
    per_rank_bytes = (large - small) * steps / k
    reduce_bandwidth = None
    if all_reduce:
        t_reduce = _time_collective("all_reduce", pg, large, repeats, device)
        reduce_bandwidth = 2 * per_rank_bytes / max(t_reduce - 2 * t_small, 1e-9)
    return (
        per_rank_bytes / max(t_large - t_small, 1e-9),
        t_small / steps,
        per_rank_bytes / max(t_scatter - t_small, 1e-9),
        reduce_bandwidth,
    )


def _mean_seconds(
    fn: Any, repeats: int, group: dist.ProcessGroup | None, device: torch.device, min_s: float = 1.0
) -> float:
    """Mean seconds of ``fn`` per run over at least ``repeats`` runs and ``min_s`` seconds, ``group``'s ranks in step.

    Two warm-up runs first (at 2 x 2 on 2 cores a model's first timed runs after one warm-up read up to 24 % slow).
    With a group, every run ends in a one-element all-reduce over it, as training's collectives hold the ranks
    together, and every rank runs the same count: ranks that run free drift apart, and the first done leaves the
    others the cores (on 2 cores, 4 ranks timing a model's step free read 6-28 % below the same step in step:
    benchmarks/JOURNAL.md, "The compute probe in step").
    """
    flag = torch.zeros(1, device=device)

    def run() -> None:
        fn()
        if group is not None:
            dist.all_reduce(flag, group=group)

    run()
    start = time.perf_counter()
    run()
    runs = max(repeats, math.ceil(min_s / max(time.perf_counter() - start, 1e-9)))
    if group is not None:  # the same count everywhere
        count = torch.tensor([runs], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        runs = int(count)
    start = time.perf_counter()
    for _ in range(runs):
        run()
    return max((time.perf_counter() - start) / runs, 1e-9)


def _unpack_step(nbytes: int, device: torch.device, copies: int = 4) -> tuple[Callable[[], None], int]:
    """(``copies`` copy-outs of a gathered buffer of about ``nbytes``, the bytes they copy).

    As the engine's unshard makes them, each re-grows a freed storage (the unshard's ``full``), copies the gathered
    buffer into it and frees it again: on the CPU the re-grown storage may fault its pages in again
    (benchmarks/JOURNAL.md, "The unshard's copy-out").
    """
    whole = torch.zeros(max(nbytes // 4, 1), device=device)
    full = torch.empty_like(whole)
    size = full.untyped_storage().size()
    full.untyped_storage().resize_(0)
    sync = _sync(device)

    def step() -> None:
        for _ in range(copies):
            full.untyped_storage().resize_(size)
            full.copy_(whole)
            full.untyped_storage().resize_(0)
        sync()

    return step, copies * size


def measure_unpack(groups: ParoGroups, nbytes: int = 16 << 20, repeats: int = 5, device: torch.device | None = None,
                   copies: int = 4) -> float:  # fmt: skip
    """The unshard's copy-out speed, bytes per second per rank (``LinkCalibration.unpack_bandwidth``).

    Every rank copies at once with the ranks in step (``_mean_seconds``), as in training; all get the ranks' mean.
    """
    device = device or torch.device("cpu")
    step, copied = _unpack_step(nbytes, device, copies)
    seconds = _mean_seconds(step, repeats, groups.whole, device, min_s=0.5)
    return copied / float(_ranks_mean(torch.tensor([seconds], dtype=torch.float64, device=device), groups)[0])


def _mlp_step(device: torch.device) -> tuple[Any, float]:
    """(a forward and backward of an MLP block, its FLOPs): the probe's stand-in for a transformer's compute.

    Two matrix products with an activation between them, on 256 tokens of width 512 (4096 x 4096 on CUDA).
    """
    sync = _sync(device)
    tokens, width = (4096, 4096) if device.type == "cuda" else (256, 512)
    layer = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)
    ).to(device)
    x = torch.randn(tokens, width, device=device)

    def layer_step() -> None:
        layer(x).sum().backward()
        sync()

    return layer_step, 6 * (4 * width * width) * tokens  # 2 FLOPs per weight and token forward, 4 backward


def _optimizer_step(shapes: list[tuple[int, ...]], device: torch.device) -> tuple[Any, int]:
    """(an AdamW step over zero tensors of ``shapes``, their element count)."""
    sync = _sync(device)
    params = [torch.nn.Parameter(torch.zeros(shape, device=device)) for shape in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params)

    def step() -> None:
        opt.step()
        sync()

    return step, sum(p.numel() for p in params)


def measure_throughputs(
    device: torch.device, repeats: int = 3, group: dist.ProcessGroup | None = None
) -> tuple[float, float]:
    """(FLOP/s of an MLP block's forward and backward, parameters/s of an AdamW step) on this rank.

    Ranks that share a machine share its cores or its GPU while they train, so every rank of ``group`` runs the
    probe at the same time and the mean of the runs counts, not the best one.
    """
    layer_step, flops = _mlp_step(device)
    flops_per_s = flops / _mean_seconds(layer_step, repeats, group, device)
    opt_step, params = _optimizer_step([(1 << 20,)], device)
    return flops_per_s, params / _mean_seconds(opt_step, repeats, group, device)


@dataclass(frozen=True)
class Overlap:
    """How a level's collectives and compute share a rank when they run at once (the cost model's rate model).

    While both run, a collective progresses at ``1 / slowdown`` of its speed alone, and compute loses
    ``1 - fraction`` seconds per second of the collective's work alone: 1 and 1 on a GPU (copy engines and NICs),
    less on ranks whose collectives run on the CPU cores their compute needs.
    """

    fraction: float
    slowdown: float

    @staticmethod
    def fraction_of(lost: float, work: float) -> float:
        """The fraction, from compute seconds ``lost`` beside collectives of ``work`` seconds alone (in [0, 1])."""
        return min(max(1.0 - lost / work, 0.0), 1.0)


@dataclass(frozen=True)
class OverlapLoops:
    """What ``measure_overlap`` timed (seconds).

    Compute steps, and a loop of ``calls`` collectives on ``nbytes`` each (the gather's output, the scatter's input),
    each alone, then compute steps run for as long as the collectives' loop ran beside them.
    """

    step: float
    """One compute step alone."""
    collectives: float
    """The collectives' loop alone."""
    collectives_beside: float
    """The collectives' loop beside compute."""
    steps_beside: int
    """The compute steps run beside it (the last one may end after it)."""
    compute_beside: float
    """Those steps' seconds."""
    calls: int
    nbytes: int

    def alone_seconds(self, group_size: int, bandwidth: float, latency: float) -> float:
        """The collectives' seconds alone as the cost model prices them (ring steps' latency, then the bytes)."""
        steps = group_size - 1
        return self.calls * (steps * latency + self.nbytes * steps / group_size / bandwidth)

    def rates(self, alone: float | None = None) -> Overlap:
        """The rate model's figures, with ``alone`` (default: the loop timed alone) as the collectives' work.

        The collectives ran beside compute all along, so their slowdown is their time beside it over their work.
        Compute ran beside them until they ended, then alone (at most the rest of one step): under the rate model
        it lost its seconds less its steps' time alone, all of it to their work. Given the calibration's price of
        the loop as ``alone``, the cost model's product of slowdown and price is what the probe timed beside
        compute, whatever the calibration read (measured in another launch: at 2 x 2 on 2 cores its intra bandwidth
        read 259-376 MB/s between runs).
        """
        work = alone if alone is not None else self.collectives
        slowdown = self.collectives_beside / work
        return Overlap(Overlap.fraction_of(self.lost_seconds(), work), slowdown=min(max(slowdown, 1.0), 100.0))

    def lost_seconds(self) -> float:
        """The compute seconds lost beside the collectives: the steps' seconds less their time alone."""
        return self.compute_beside - self.steps_beside * self.step


def measure_overlap(
    device: torch.device,
    group: dist.ProcessGroup,
    step: Any = None,
    nbytes: int = 4 << 20,
    loop_s: float = 0.1,
    trials: int = 3,
    align: dist.ProcessGroup | None = None,
    op: str = "all_gather",
    loop_steps: int = 1,
) -> OverlapLoops:
    """How communication over ``group`` and compute share this rank when they run at once (see ``OverlapLoops``).

    Times compute steps (``step``, default an MLP block's forward and backward) alone (a loop of at least
    ``loop_s`` and of ``loop_steps`` steps: shorter loops are mostly scheduling noise), a loop of the engine's
    all-gathers (or, with ``op`` "reduce_scatter", its reduce-scatters) over ``group`` that takes about as long, and
    the collectives' loop on a thread (as the engine issues them) with compute steps run until it ends; the median
    of ``trials`` of each figure. Every loop starts after a barrier on ``align`` (default ``group``), so that ranks
    sharing a machine run the same loop.
    """
    sync = _sync(device)
    layer_step = step if step is not None else _mlp_step(device)[0]
    call = _collective(op, group, nbytes, device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    repeats, calls = 1, 1  # then enough steps for loop_s, and collectives that take about as long

    def computes() -> None:
        for _ in range(repeats):
            layer_step()

    def collectives() -> None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for _ in range(calls):
                call()
            sync()

    def timed(fn: Any) -> float:
        dist.barrier(group=align or group)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def both() -> tuple[float, int, float]:
        """(the collectives' seconds, the compute steps run beside them, those steps' seconds)."""
        ended: list[float] = []
        failed: list[BaseException] = []

        def timed_collectives() -> None:
            try:
                collectives()
            except BaseException as e:  # e.g. a peer died: raised on the calling thread below
                failed.append(e)
            ended.append(time.perf_counter() - start)

        dist.barrier(group=align or group)
        start = time.perf_counter()
        thread = threading.Thread(target=timed_collectives, name="paro-probe-collectives")
        thread.start()
        steps = 0
        while thread.is_alive() or steps == 0:
            layer_step()
            steps += 1
        compute_s = time.perf_counter() - start
        thread.join()
        if failed:
            raise failed[0]
        return ended[0], steps, compute_s

    one_call, one_step = timed(collectives), timed(computes)  # also the warm-up
    repeats = min(max(round(loop_s / max(one_step, 1e-9)), loop_steps, 1), 64)
    n = torch.tensor([repeats, min(max(round(repeats * one_step / max(one_call, 1e-9)), 1), 256)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=align or group)  # the same loops everywhere
    repeats, calls = int(n[0]), int(n[1])
    runs = [(timed(computes) / repeats, timed(collectives), *both()) for _ in range(trials)]
    medians = [sorted(figure)[len(runs) // 2] for figure in zip(*runs, strict=True)]
    return OverlapLoops(*medians, calls=calls, nbytes=nbytes)


def _link_round(groups: ParoGroups, small: int, large: int, repeats: int, device: torch.device) -> torch.Tensor:
    """One round of the link probe, the same on every rank: both levels' figures, the ranks' pessimistic ones.

    ``[intra latency, inter latency, -intra bandwidth, -inter bandwidth, -intra reduce-scatter bandwidth, -inter
    reduce-scatter bandwidth, -inter all-reduce bandwidth]`` (float64): the slowest rank's (max latency, min
    bandwidth; bandwidths negated so that one MAX all-reduce takes both).
    """
    dist.barrier(group=groups.whole)  # every rank probes the same level at once, as in training
    intra_bw, intra_lat, intra_rs, _ = _level(groups.intra, small, large, repeats, device)
    dist.barrier(group=groups.whole)
    inter_bw, inter_lat, inter_rs, inter_ar = _level(groups.inter, small, large, repeats, device, all_reduce=True)
    assert inter_ar is not None
    figures = [intra_lat, inter_lat, -intra_bw, -inter_bw, -intra_rs, -inter_rs, -inter_ar]
    t = torch.tensor(figures, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups.whole)
    return t


def measure_links(
    groups: ParoGroups,
    small: int = 4 << 10,
    large: int = 16 << 20,
    repeats: int = 5,
    device: torch.device | None = None,
    throughputs: bool = True,
    rounds: int = 3,
) -> LinkCalibration:
    """Measures both levels, the copy-out and, with ``throughputs``, the ranks' throughputs on ``device``.

    ``device`` defaults to the CPU; the copy-out is ``measure_unpack``'s. The throughputs and overlaps come from
    stand-in steps (an MLP block, AdamW); without ``throughputs`` they are left unmeasured, for ``probe_model`` to
    measure on the model. Every rank returns the same figures (the links' of the slowest rank, the throughputs' and
    the copy-out's of the ranks' mean).

    The links are probed in ``rounds`` rounds, each figure the median over them: one round can read far off (at
    2 x 4 on 2 cores, the training benchmark's probes read the intra-group bandwidth 98-333 MB/s between launches,
    and eight rounds in one launch 127-351 MB/s, the first round the lowest: benchmarks/investigations/probe-rounds/).

    On ranks that share cores the small gather's time after a barrier includes the ranks' skew, which training's
    collectives pay too: its median over 21 repeats and over ranks (0.48 ms between groups where this read 23.6 ms)
    made the predictions of the strategies with p = I or G 17-41 % low at 2 x 2 / 200 Mbit/s
    (benchmarks/JOURNAL.md, "2 x 2 at 200 Mbit/s, two launches per cell").
    """
    if rounds < 1:
        raise ValueError(f"measure_links: rounds={rounds}; probe at least one round")
    device = device or torch.device("cpu")
    every = torch.stack([_link_round(groups, small, large, repeats, device) for _ in range(rounds)])
    t = torch.quantile(every, 0.5, dim=0)  # of an even count: the mean of the middle two
    links = LinkCalibration(
        intra=Link(float(-t[2]), float(t[0]), reduce_scatter_bandwidth=float(-t[4])),
        inter=Link(float(-t[3]), float(t[1]), reduce_scatter_bandwidth=float(-t[5]), all_reduce_bandwidth=float(-t[6])),
        unpack_bandwidth=measure_unpack(groups, large, repeats, device),
    )
    if not throughputs:
        return links
    seconds = torch.tensor([1 / x for x in measure_throughputs(device, repeats, groups.whole)], dtype=torch.float64)
    seconds = _ranks_mean(seconds.to(device), groups)
    throughputs = {"compute_flops": 1 / float(seconds[0]), "optimizer_params_per_s": 1 / float(seconds[1])}
    links = dataclasses.replace(links, compute_probe="mlp block", **throughputs)
    return _overlaps(links, groups, device)


def _ranks_mean(seconds: torch.Tensor, groups: ParoGroups) -> torch.Tensor:
    """The mean over ranks of each rank's timed ``seconds``, on every rank.

    Not the slowest rank's: ranks that share cores take turns on them, and between two synchronizations each runs at
    the ranks' mean rate (at 2 x 2 on 2 cores the slowest rank's mean of 3 runs read 27 % below to 5 % above the
    ranks' mean over 12 synchronized steps).
    """
    dist.all_reduce(seconds, group=groups.whole)
    return seconds / groups.world


_PROBED = [(level, op) for level in ("intra", "inter") for op in ("all_gather", "reduce_scatter")]


def overlaps_from_loops(links: LinkCalibration, groups: ParoGroups) -> LinkCalibration:
    """``links`` with each level's overlap figures derived from ``links.overlap_loops``, priced by its own links.

    The gathers give a level's ``slowdown``, the reduce-scatters its ``reduce_scatter_slowdown``, and both together
    its ``overlap`` (the compute they cost over their work: one loop's loss is a small difference of two timings,
    noisy on shared cores; one launch read 0.99 from the gathers' alone where others read 0.0-0.4).
    """
    assert links.overlap_loops is not None
    figures: dict[str, dict[str, float]] = {"intra": {}, "inter": {}}
    lost = {"intra": 0.0, "inter": 0.0}  # compute seconds lost beside the level's loops, and their work
    work = {"intra": 0.0, "inter": 0.0}
    for level, op in _PROBED:
        k = groups.group_size if level == "intra" else groups.num_groups  # the level's ranks
        link = links.level(level)
        if k == 1:
            rates = Overlap(1.0, 1.0)
            figures[level]["overlap"] = 1.0
        else:
            bandwidth = link.bandwidth
            if op == "reduce_scatter":
                bandwidth = link.reduce_scatter_bandwidth or bandwidth
            loops = OverlapLoops(*links.overlap_loops[f"{level}_{op}"])
            alone = loops.alone_seconds(k, bandwidth, link.latency)
            rates = loops.rates(alone)
            lost[level] += loops.lost_seconds()
            work[level] += alone
        if op == "all_gather":
            figures[level]["slowdown"] = rates.slowdown
        else:
            figures[level]["reduce_scatter_slowdown"] = rates.slowdown
    for level, seconds in work.items():
        if seconds > 0:
            figures[level]["overlap"] = Overlap.fraction_of(lost[level], seconds)
    intra, inter = (dataclasses.replace(links.level(level), **figures[level]) for level in ("intra", "inter"))
    return dataclasses.replace(links, intra=intra, inter=inter)


def _overlaps(
    links: LinkCalibration, groups: ParoGroups, device: torch.device, step: Any = None, loop_steps: int = 1
) -> LinkCalibration:
    """``links`` with ``measure_overlap``'s loops of both levels and the overlap figures they give.

    Each loop figure is the ranks' median (``overlaps_from_loops`` prices them); the median, not the mean: on shared
    cores one rank's figure can read several times the others' (a noisy figure, not a bound).
    """
    loops = []
    for level, op in _PROBED:
        pg = groups.intra if level == "intra" else groups.inter
        found = (
            measure_overlap(device, pg, step, align=groups.whole, op=op, loop_steps=loop_steps)
            if pg is not None
            else None
        )
        none = (0.0,) * len(dataclasses.fields(OverlapLoops))  # a level of one rank: nothing to probe
        loops.append(dataclasses.astuple(found) if found is not None else none)
    t = torch.tensor(loops, dtype=torch.float64, device=device)
    every = [torch.empty_like(t) for _ in range(groups.world)]
    dist.all_gather(every, t, group=groups.whole)
    t = torch.quantile(torch.stack(every), 0.5, dim=0)  # of an even count: the mean of the middle two
    recorded = {f"{level}_{op}": [float(x) for x in row] for (level, op), row in zip(_PROBED, t, strict=True)}
    return overlaps_from_loops(dataclasses.replace(links, overlap_loops=recorded), groups)


def probe_groups(group_size: int | None = None) -> ParoGroups:
    """This job's intra-group and inter-group communicators, as the probes here take them; every rank must call it.

    ``group_size``: ranks per group; default PARO_GROUP_SIZE, else torchrun's LOCAL_WORLD_SIZE, else all ranks.
    """
    return build_groups(group_size)


def calibrate(
    path: str | os.PathLike[str] | None = None, group_size: int | None = None, device: torch.device | None = None
) -> LinkCalibration:
    """Measures the links of this job's topology and the throughputs on ``device`` (default: the CPU).

    Rank 0 writes them to ``path`` when given.
    """
    links = measure_links(build_groups(group_size), device=device)
    if path is not None and dist.get_rank() == 0:
        links.save(path)
    return links


def _loss(output: Any) -> torch.Tensor:
    """A scalar to run backward from: the output's ``loss`` (Hugging Face), else the sum of its first float tensor."""
    loss = getattr(output, "loss", None)
    if torch.is_tensor(loss):
        return loss
    for t in tree_flatten(output)[0]:
        if torch.is_tensor(t) and t.is_floating_point() and t.requires_grad:
            return t.float().sum()
    raise ValueError("example_inputs: the model's output has no loss and no float tensor that needs a gradient")


def probe_model(
    links: LinkCalibration,
    groups: ParoGroups,
    module: torch.nn.Module,
    example_inputs: Any,
    flops: float,
    device: torch.device,
    repeats: int = 5,
    dtype: torch.dtype | None = None,
    overlap_steps: int = 2,
) -> LinkCalibration:
    """``links`` with the compute and optimizer throughputs and the overlaps measured on the model itself.

    ``example_inputs`` is one micro-batch: a dict of keyword arguments, a tuple of positional ones or a tensor.
    Compute: ``flops`` (what the cost model counts for the batch, ``model_flops``) over the seconds of the model's
    forward and backward, so that the figure calibrates the model's count, whatever the model spends beside
    matrix products (norms, attention, the loss, Python). The seconds are the mean of two timings of the step with
    the ranks in step (``_mean_seconds``), one before the overlap probe and one after it (the overlap loops' own
    timings of the step run free and read low). Overlap: ``measure_overlap`` with that step as the compute, in
    loops of at least ``overlap_steps`` steps (a model step is often longer than the default loop; at 2 x 2 on 2
    cores the intra-group slowdown read 2.3 to 9.0 over 16 launches with the default loops, 3.0 to 5.1 over 8 with
    loops five times as long: benchmarks/JOURNAL.md, "Probe loop length and the switch interval"). Optimizer: AdamW
    over zero tensors shaped as the model's trainable parameters (the first ones, up to 2^22 elements), since how fast
    it runs depends on the tensors' sizes as well as their total. Every rank runs at once, as in training; all get
    the ranks' mean seconds (see ``_ranks_mean``). With ``dtype`` (mixed precision's compute dtype) the model runs
    under autocast to it. Random state and the parameters' values, gradients and buffers are as before.
    """
    if isinstance(example_inputs, dict):
        args, kwargs = (), example_inputs
    else:
        args, kwargs = (example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)), {}
    sync = _sync(device)
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [(b, b.clone()) for b in module.buffers()]  # e.g. BatchNorm statistics that a forward updates

    low = dtype is not None and dtype != torch.float32

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype) if low else contextlib.nullcontext():
            loss = _loss(module(*args, **kwargs))
        loss.backward()
        sync()

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        first = _mean_seconds(step, repeats, groups.whole, device)
        links = _overlaps(links, groups, device, step, loop_steps=overlap_steps)
        seconds = [(first + _mean_seconds(step, repeats, groups.whole, device)) / 2]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    shapes, total = [], 0
    for p in params:
        if total >= 1 << 22:
            break
        shapes.append(tuple(p.shape))
        total += p.numel()
    if shapes:
        opt_step, numel = _optimizer_step(shapes, device)
        seconds.append(_mean_seconds(opt_step, repeats, groups.whole, device) / numel)  # per parameter
    t = _ranks_mean(torch.tensor(seconds, dtype=torch.float64, device=device), groups)
    return dataclasses.replace(
        links,
        compute_flops=flops / float(t[0]),
        compute_probe="model",
        optimizer_params_per_s=1 / float(t[1]) if shapes else links.optimizer_params_per_s,
    )


def _request(
    blocks: list[dict[str, Any]],
    groups: ParoGroups,
    links: LinkCalibration,
    memory_budget: int,
    training: dict[str, Any],
    tokens_per_micro_step: int | None,
    shared_cores: bool = False,
) -> dict[str, Any]:
    """The cost model's request (see ``paro plan --help`` and the Rust ``cost::request``).

    ``shared_cores``: the ranks compute and run their collectives on the same CPU cores (CPU ranks): the cost model
    takes a collective's work beside compute from compute.
    """
    cluster: dict[str, Any] = {
        "world": groups.world,
        "group_size": groups.group_size,
        "memory_bytes": memory_budget,
        "shared_cores": shared_cores,
    }
    for name, value in links.to_record().items():  # the request names the figures as the saved form does
        if value is not None and name not in ("compute_flops", "compute_probe", "overlap_loops"):
            cluster[name] = value
    training = dict(training)
    if tokens_per_micro_step is not None and links.compute_flops is not None:
        cluster["compute_flops"] = links.compute_flops
        training.update(micro_batch=1, seq_len=tokens_per_micro_step)
    return {
        "model": {"blocks": blocks},
        "cluster": cluster,
        "training": training,
        "collectives": "phased",  # the engine issues a global call's levels one after the other on its lane
    }


def cost_blocks(module: torch.nn.Module, wrap_policy: Any, world: int, group_size: int) -> list[dict[str, Any]]:
    """The cost model's units of ``module`` (``estimate``'s ``blocks``), as ``ParoShardedModule`` makes them.

    One unit per module that ``wrap_policy`` wraps (a set of module classes or a callable, as ParoShardedModule
    takes it), then the root with the rest; each with its parameter counts and its buffers' padded sizes on
    ``world`` ranks in groups of ``group_size`` (``ParoShardedModule.cost_blocks`` for that module). The module may
    be on the meta device: nothing is allocated or communicated.
    """
    from paro_torch._engine.planning import cost_blocks as unit_blocks  # not at the top: it imports this module
    from paro_torch._engine.units import assign_units

    shape = SimpleNamespace(world=world, group_size=group_size)  # all that the sizes depend on
    return unit_blocks([a[1] for a in assign_units(module, wrap_policy)], shape)  # type: ignore[arg-type]


def model_flops(
    blocks: list[dict[str, Any]], groups: ParoGroups, tokens: int, activation_checkpointing: bool = False
) -> float:
    """The FLOPs the cost model counts for one forward and backward of the model (its ``blocks``) on ``tokens``."""
    unit_rate = LinkCalibration(Link(1.0, 0.0), Link(1.0, 0.0), compute_flops=1.0)  # 1 FLOP/s: seconds are FLOPs
    report = estimate(blocks, groups, links=unit_rate, memory_budget=1 << 62, grad_accum=1, sizes={},
                      tokens_per_micro_step=tokens, activation_checkpointing=activation_checkpointing,
                      only="NNN")  # fmt: skip
    return float(report["strategies"][0]["step"]["compute_s"])


def default_memory_budget(group_size: int) -> int:
    """Free GPU memory on CUDA machines; otherwise the host's memory shared by the ranks of one group."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(group_size, 1)


def estimate(
    blocks: list[dict[str, Any]],
    groups: ParoGroups,
    *,
    links: LinkCalibration,
    memory_budget: int,
    grad_accum: int,
    sizes: dict[str, int],
    tokens_per_micro_step: int | None = None,
    activation_checkpointing: bool = False,
    clip_grad_norm: bool = False,
    only: str | None = None,
    shared_cores: bool = False,
) -> dict[str, Any]:
    """The cost model's report for this model and cluster, on this rank alone (``choose_strategy`` agrees on it).

    With ``tokens_per_micro_step`` (and a measured compute throughput) the predicted step includes compute, which
    hides communication (``activation_checkpointing`` adds the recomputation); without it, the step is the
    communication schedule alone. ``clip_grad_norm``: each step clips the gradients' norm (one more small
    all-reduce). With ``only``, that one strategy instead of all. ``shared_cores``: CPU ranks (see ``_request``).
    """
    training = {
        "grad_accum": grad_accum,
        "activation_checkpointing": activation_checkpointing,
        "clip_grad_norm": clip_grad_norm,
        **sizes,
    }
    request = _request(blocks, groups, links, memory_budget, training, tokens_per_micro_step, shared_cores)
    if only is not None:
        request["strategies"] = [only]
    return json.loads(_C.estimate(json.dumps(request)))


def choose_strategy(report: dict[str, Any], groups: ParoGroups, *, memory_budget: int, only: str | None = None) -> str:
    """Rank 0's choice in its ``report`` (``estimate``'s), on every rank: the fastest strategy that fits, or ``only``.

    Raises:
        ValueError: nothing (or ``only``) fits the memory budget, raised on every rank, with what it needs.
    """
    codes = _C.STRATEGIES
    choice = report["choice"]
    index = torch.tensor([codes.index(choice["code"]) if choice else -1], dtype=torch.int64)
    dist.broadcast(index, src=0, group=groups.whole)  # rank 0 decides
    if index.item() < 0 and only is not None:
        need = report["strategies"][0]["memory"]["total"]
        raise ValueError(
            f"strategy {only} needs {need / 1e9:.3f} GB per rank but memory_budget is {memory_budget / 1e9:.3f} GB; "
            "choose a finer strategy (e.g. strategy='auto'), use more ranks or raise memory_budget."
        )
    if index.item() < 0:
        raise ValueError(
            f"strategy='auto' found no strategy that fits {memory_budget / 1e9:.2f} GB per rank: {report['reason']}. "
            "Raise memory_budget, use more ranks per group or a smaller model."
        )
    return codes[int(index.item())]
