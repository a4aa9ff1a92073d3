"""The ``paro`` torch.distributed backend (PaRO-CC), multi-process on CPU."""

import time

import pytest
import torch
import torch.distributed as dist
from launch import assert_ok, launch, torchrun

pytestmark = pytest.mark.multiproc

# (world, group size): 2 groups x 2, 2 x 4, 4 x 2, one rank per group, one group
SHAPES = [(4, 2), (8, 4), (8, 2), (4, 1), (4, 4)]


@pytest.mark.parametrize("world,group_size", SHAPES, ids=[f"{w // m}x{m}" for w, m in SHAPES])
def test_every_collective_matches_the_reference(world: int, group_size: int) -> None:
    """Every collective against Gloo's; with two levels, also the bytes counted per level against the ring
    formulas (workers/stats.py) on paro groups made by new_group."""
    # small chunks, so that the pipelined multi-chunk plans run too
    env = {"PARO_GROUP_SIZE": str(group_size), "PARO_CHUNK_BYTES": "256"}
    out = assert_ok(launch("collectives.py", world, env=env))
    assert ("stats OK" in out) == (1 < group_size < world), out[-2000:]


def test_frameworks_train_like_one_process() -> None:
    """DDP, FSDP1 (full and hybrid), FSDP2 and HSDP on the paro backend, one after another in one launch."""
    frameworks = "ddp,fsdp1_full,fsdp1_hybrid,fsdp2,hsdp"
    assert_ok(launch("frameworks.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=(frameworks,)))


def test_deepspeed_zero3_trains_like_one_process() -> None:
    pytest.importorskip("deepspeed")
    assert_ok(launch("deepspeed_zero3.py", 4, env={"PARO_GROUP_SIZE": "2"}))


def test_a_script_without_destroy_process_group_exits_cleanly() -> None:
    """One run here; scripts/clean_exits.py repeats it (and the framework workers) 50 times."""
    out = assert_ok(launch("no_destroy.py", 4, env={"PARO_GROUP_SIZE": "2"}))
    assert "done without destroy_process_group" in out, out


def test_the_worker_thread_never_frees_a_callers_tensor() -> None:
    """The cause of the abort at exit (clean exits): a tensor freed on the worker while the interpreter exits."""
    out = assert_ok(launch("tensor_lifetimes.py", 4, env={"PARO_GROUP_SIZE": "2"}))
    assert "all freed on the main thread" in out, out


def test_frameworks_on_four_groups() -> None:
    assert_ok(launch("frameworks.py", 8, env={"PARO_GROUP_SIZE": "2"}, args=("hsdp",)))


@pytest.mark.parametrize("mode", ["exit", "stuck"])
def test_a_dead_rank_ends_the_job_with_an_error(mode: str) -> None:
    start = time.monotonic()
    results = launch("dead_rank.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=(mode,), timeout=120)
    for r in results:
        if r.rank == 1:
            continue
        assert r.returncode == 0 and "error raised" in r.output, r.output[-2000:]
    assert time.monotonic() - start < 100


def test_collectives_appear_in_the_profiler_with_sizes_level_and_sequence_number() -> None:
    assert_ok(launch("observability.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=("trace",)))


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


def test_counters_work_under_distributed_debug_detail() -> None:
    env = {"PARO_GROUP_SIZE": "2", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    assert_ok(launch("observability.py", 4, env=env, args=("stats",)))


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
