"""The ``paro`` torch.distributed backend (PaRO-CC), multi-process on CPU."""

import importlib.util
import time

import pytest
import torch
import torch.distributed as dist
from launch import Case, RankResult, Shared, assert_ok, launch, torchrun

# (world, group size): 2 groups x 2, 2 x 4, 4 x 2, one rank per group, one group
SHAPES = [(4, 2), (8, 4), (8, 2), (4, 1), (4, 4)]
SHAPE_IDS = [f"{w // m}x{m}" for w, m in SHAPES]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
G2 = {"PARO_GROUP_SIZE": "2"}


def _cases(world: int) -> dict[str, Case]:
    """The tests' workers on ``world`` ranks, each case keyed by its test."""
    cases = {}
    for (w, m), shape in zip(SHAPES, SHAPE_IDS, strict=True):
        if w == world:  # small chunks, so that the pipelined multi-chunk plans run too
            env = {"PARO_GROUP_SIZE": str(m), "PARO_CHUNK_BYTES": "256"}
            cases[f"test_every_collective_matches_the_reference[{shape}]"] = Case("collectives.py", (), env)
    if world == 8:
        cases["test_frameworks_on_four_groups"] = Case("frameworks.py", ("hsdp",), G2)
        return cases
    frameworks = "ddp,fsdp1_full,fsdp1_hybrid,fsdp2,hsdp"
    cases["test_frameworks_train_like_one_process"] = Case("frameworks.py", (frameworks,), G2)
    cases["test_the_worker_thread_never_frees_a_callers_tensor"] = Case("tensor_lifetimes.py", (), G2)
    trace = Case("observability.py", ("trace",), G2)
    cases["test_collectives_appear_in_the_profiler_with_sizes_level_and_sequence_number"] = trace
    detail = {**G2, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    cases["test_counters_work_under_distributed_debug_detail"] = Case("observability.py", ("stats",), detail)
    if HAS_DEEPSPEED:  # last: DeepSpeed keeps its own state about the process group
        cases["test_deepspeed_zero3_trains_like_one_process"] = Case("deepspeed_zero3.py", (), G2)
    return cases


# The workers that exit as they would alone run as cases of two launches, one per world size (start-up dominates a
# short worker's run on 2 cores); every case gets a new default process group, as a worker of its own would. The
# workers whose ranks die, hang or never destroy their groups run alone.
SHARED = [Shared(4, _cases(4)), Shared(8, _cases(8))]

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(max(s.timeout_s for s in SHARED))]


@pytest.mark.parametrize("world,group_size", SHAPES, ids=SHAPE_IDS)
def test_every_collective_matches_the_reference(world: int, group_size: int, ranks: list[RankResult]) -> None:
    """Every collective against Gloo's; with two levels, also the bytes counted per level against the ring
    formulas (workers/stats.py) on paro groups made by new_group."""
    out = assert_ok(ranks)
    assert ("stats OK" in out) == (1 < group_size < world), out[-2000:]


def test_frameworks_train_like_one_process(ranks: list[RankResult]) -> None:
    """DDP, FSDP1 (full and hybrid), FSDP2 and HSDP on the paro backend, one after another in one launch."""
    assert_ok(ranks)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeed_zero3_trains_like_one_process(ranks: list[RankResult]) -> None:
    assert_ok(ranks)


def test_a_script_without_destroy_process_group_exits_cleanly() -> None:
    """One run here; scripts/clean_exits.py repeats it (and the framework workers) 50 times."""
    out = assert_ok(launch("no_destroy.py", 4, env={"PARO_GROUP_SIZE": "2"}))
    assert "done without destroy_process_group" in out, out


def test_the_worker_thread_never_frees_a_callers_tensor(ranks: list[RankResult]) -> None:
    """The cause of the abort at exit (clean exits): a tensor freed on the worker while the interpreter exits."""
    out = assert_ok(ranks)
    assert "all freed on the main thread" in out, out


def test_frameworks_on_four_groups(ranks: list[RankResult]) -> None:
    assert_ok(ranks)


@pytest.mark.parametrize("mode", ["exit", "stuck"])
def test_a_dead_rank_ends_the_job_with_an_error(mode: str) -> None:
    start = time.monotonic()
    results = launch("dead_rank.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=(mode,), timeout=120)
    for r in results:
        if r.rank == 1:
            continue
        assert r.returncode == 0 and "error raised" in r.output, r.output[-2000:]
    assert time.monotonic() - start < 100


def test_collectives_appear_in_the_profiler_with_sizes_level_and_sequence_number(ranks: list[RankResult]) -> None:
    assert_ok(ranks)


@pytest.mark.parametrize("debug", ["OFF", "DETAIL"])
def test_the_error_of_a_desynchronised_rank_tells_it_apart(debug: str) -> None:
    env = {"PARO_GROUP_SIZE": "2", "TORCH_DISTRIBUTED_DEBUG": debug}
    results = launch("observability.py", 4, env=env, args=("desync",), timeout=120)
    for r in results:
        assert r.returncode == 0, r.output[-2000:]
        if debug == "DETAIL":  # torch's checker (needs the group's sequence number) names the mismatch
            assert "Detected mismatch between collectives" in r.output and "_ALLGATHER_BASE" in r.output, r.output
        else:  # each rank's error names its own collective and its number: rank 1's differs
            op = "all_gather_into_tensor" if r.rank == 1 else "all_reduce"
            assert f"paro: {op} #2 (1000 elements of Float) on rank {r.rank} of 4 failed" in r.output, r.output


def test_counters_work_under_distributed_debug_detail(ranks: list[RankResult]) -> None:
    assert_ok(ranks)


@pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.14",
    reason="torch before 2.14 lets only Gloo groups call monitored_barrier",
)
def test_a_monitored_barrier_names_the_rank_that_did_not_arrive() -> None:
    results = launch("observability.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=("monitored",), timeout=120)
    for r in results:
        assert r.returncode == 0, r.output[-2000:]
    assert "Rank 1 failed to pass monitoredBarrier" in results[0].output, results[0].output[-2000:]


@pytest.mark.skipif(
    not hasattr(dist.Backend, "_ensure_backend_registered"),
    reason="torch before 2.14 loads no torch.distributed.backends entry points",
)
def test_torchrun_finds_the_backend_through_its_entry_point() -> None:
    code, output = torchrun("entry_point.py", env={"PARO_GROUP_SIZE": "2"}, timeout=300)
    assert code == 0, output[-6000:]
    assert output.count("entry point OK") == 4


def test_group_size_that_does_not_divide_the_world_fails_on_every_rank() -> None:
    results = launch("entry_point.py", 4, env={"PARO_GROUP_SIZE": "3"}, timeout=120)
    for r in results:
        assert r.returncode != 0 and "world size 4 is not divisible by group size 3" in r.output, r.output[-2000:]
