"""ParoShardedModule (PaRO-DP), multi-process on CPU: equivalence, accounting, bad input."""

import pytest
from launch import assert_ok, launch

pytestmark = pytest.mark.multiproc

# (world, group size, variants): 2 x 2 trains every variant; the 8-rank shapes one each (8 processes on 2 cores
# train 6x slower than 4, and the three variants at both took 11 minutes of the suite)
SHAPES = [(4, 2, "plain,frozen,lora"), (8, 4, "frozen"), (8, 2, "lora")]
IDS = [f"{w // m}x{m}" for w, m, _ in SHAPES]


@pytest.mark.parametrize("world,group_size,variants", SHAPES, ids=IDS)
def test_all_strategies_train_like_one_process(world: int, group_size: int, variants: str) -> None:
    """14 strategies x the shape's variants (all trainable, 1/4 frozen, LoRA) x AdamW x 2 micro-steps x 4 steps,
    within 1e-5."""
    assert_ok(launch("engine.py", world, env={"PARO_GROUP_SIZE": str(group_size)}, args=(variants,)))


def test_clipping_bf16_fp16_tied_weights_and_sync_on_every_micro_step() -> None:
    assert_ok(launch("engine.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=("clip,bf16,fp16,tied,syncall",)))


@pytest.mark.parametrize("mode", ["destroy", "keep", "module"])
def test_collectives_in_flight_at_exit_do_not_abort_the_process(mode: str) -> None:
    """Gloo threads that free a tensor while the interpreter finalizes abort the process: see
    [Note: communicators at exit] in _groups.py. With and without destroy_process_group, and a model left alive."""
    assert_ok(launch("exit_in_flight.py", 4, args=(mode,), timeout=120))


def test_groups_from_a_device_mesh() -> None:
    assert_ok(launch("engine.py", 4, env={"PARO_GROUP_SIZE": "2"}, args=("mesh", "IIG", "NGG", "III")))


@pytest.mark.parametrize("world,group_size", [(4, 2), (8, 2)], ids=["2x2", "4x2"])
def test_memory_and_bytes_equal_the_cost_model(world: int, group_size: int) -> None:
    variants = "plain,frozen,bf16" if world == 4 else "frozen"
    assert_ok(launch("engine_accounting.py", world, env={"PARO_GROUP_SIZE": str(group_size)}, args=(variants,)))


@pytest.mark.parametrize(
    "case,message",
    [
        ("unknown", "unknown strategy"),
        ("eliminated", "INI dominates"),
        ("group_size", "not divisible by group size 3"),
        ("disagree_strategy", "ranks disagree"),
        ("disagree_group_size", "ranks disagree"),
        ("disagree_model", "ranks disagree"),
        ("int_param", "floating-point"),
        ("tied_across_units", "shared between modules of different units"),
        ("meta_uninitialised", "nothing initialises ['1.weight']"),
        ("wrapped_twice", "is a DTensor already: the model was wrapped before"),
    ],
)
def test_bad_input_fails_on_every_rank(case: str, message: str) -> None:
    results = launch("engine_errors.py", 4, args=(case,), timeout=120)
    assert_ok(results)
    assert any(message in r.output for r in results), [r.output[-500:] for r in results]
    for r in results:
        assert "Error" in r.output, r.output[-500:]


def test_groups_must_match_the_torchrun_layout() -> None:
    """6 ranks as 2 torchrun nodes of 3: groups of 2 would straddle the nodes, and every rank says so."""
    results = launch("engine_errors.py", 6, env={"LOCAL_WORLD_SIZE": "3"}, args=("layout",), timeout=120)
    assert_ok(results)
    for r in results:
        assert "does not match torchrun's layout of 3 ranks per node" in r.output, r.output[-500:]


def test_auto_measures_chooses_and_agrees() -> None:
    assert_ok(launch("engine_auto.py", 4, env={"PARO_GROUP_SIZE": "2"}))


def test_activation_checkpointing_keeps_units_sharded_in_backward() -> None:
    """GGG: the peak of unsharded units in backward with checkpointing (reentrant or not, early stop on or off) is
    at most that without it (root + computing + prefetched = 3 of 7 units)."""
    assert_ok(launch("engine_unsharded.py", 4, env={"PARO_GROUP_SIZE": "2"}, timeout=180))


def test_modules_on_the_same_groups_share_communicators_and_train_together() -> None:
    """An encoder and a decoder wrapped apart, one loss: one process's parameters (1e-5), no new process groups."""
    assert_ok(launch("engine_shared.py", 4, env={"PARO_GROUP_SIZE": "2"}, timeout=180))
