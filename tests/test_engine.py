"""ParoShardedModule (PaRO-DP), multi-process on CPU: equivalence, accounting, bad input."""

import pytest
from launch import Case, RankResult, Shared, assert_ok, launch

# (id, world, group size, variants): 2 x 2 trains every variant; the 8-rank shapes one each (8 processes on 2 cores
# train 6x slower than 4, and the three variants at both took 11 minutes of the suite)
SHAPES = [("2x2", 4, 2, "plain,frozen,lora"), ("2x4", 8, 4, "frozen"), ("4x2", 8, 2, "lora")]
ACCOUNTING = [("2x2", 4, 2, "plain,frozen,bf16,bf16model"), ("4x2", 8, 2, "frozen")]
BAD_INPUT = [
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
]
BAD_INPUT_IDS = [f"{case}-{message}" for case, message in BAD_INPUT]
G2 = {"PARO_GROUP_SIZE": "2"}


def _cases(world: int) -> dict[str, Case]:
    """The tests' workers on ``world`` ranks, each case keyed by its test."""
    cases = {}
    for shape, w, m, variants in SHAPES:
        if w == world:  # 14 strategies x the shape's variants
            cases[f"test_all_strategies_train_like_one_process[{shape}]"] = Case(
                "engine.py", (variants,), {"PARO_GROUP_SIZE": str(m)}
            )
    if world == 4:
        variants = "clip,bf16,fp16,tied,syncall"
        cases["test_clipping_bf16_fp16_tied_weights_and_sync_on_every_micro_step"] = Case("engine.py", (variants,), G2)
        cases["test_groups_from_a_device_mesh"] = Case("engine.py", ("mesh", "IIG", "NGG", "III"), G2)
        # the model's own dtype kept without a policy: float64 to 1e-12 (float32 anywhere: ~1e-7), as FSDP2
        cases["test_the_models_dtype_is_kept[float64]"] = Case("engine.py", ("float64",), G2)
        cases["test_the_models_dtype_is_kept[converted]"] = Case(
            "engine.py", ("double,bf16model", "NNN", "NIG", "NGG", "IIG", "GGG"), G2
        )
    for shape, w, m, variants in ACCOUNTING:
        if w == world:
            cases[f"test_memory_and_bytes_equal_the_cost_model[{shape}]"] = Case(
                "engine_accounting.py", (variants,), {"PARO_GROUP_SIZE": str(m)}
            )
    if world == 4:
        for (case, _), case_id in zip(BAD_INPUT, BAD_INPUT_IDS, strict=True):
            cases[f"test_bad_input_fails_on_every_rank[{case_id}]"] = Case("engine_errors.py", (case,), limit_s=120)
        cases["test_auto_measures_chooses_and_agrees"] = Case("engine_auto.py", env=G2)
        unsharded = Case("engine_unsharded.py", (), G2, 180)
        cases["test_activation_checkpointing_keeps_units_sharded_in_backward"] = unsharded
        cases["test_modules_on_the_same_groups_share_communicators_and_train_together"] = Case(
            "engine_shared.py", (), G2, 180
        )
    return cases


# The workers that exit as they would alone run as cases of two launches, one per world size (start-up dominates a
# short worker's run on 2 cores); every case gets a new default process group, as a worker of its own would.
SHARED = [Shared(4, _cases(4)), Shared(8, _cases(8))]

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(max(s.timeout_s for s in SHARED))]


@pytest.mark.parametrize("shape", [s[0] for s in SHAPES])
def test_all_strategies_train_like_one_process(shape: str, ranks: list[RankResult]) -> None:
    """14 strategies x the shape's variants (all trainable, 1/4 frozen, LoRA) x AdamW x 2 micro-steps x 3 steps,
    within 1e-5."""
    assert_ok(ranks)


def test_clipping_bf16_fp16_tied_weights_and_sync_on_every_micro_step(ranks: list[RankResult]) -> None:
    assert_ok(ranks)


@pytest.mark.parametrize("mode", ["destroy", "keep", "module"])
def test_collectives_in_flight_at_exit_do_not_abort_the_process(mode: str) -> None:
    """Gloo threads that free a tensor while the interpreter finalizes abort the process: see
    [Note: communicators at exit] in _groups.py. With and without destroy_process_group, and a model left alive."""
    assert_ok(launch("exit_in_flight.py", 4, args=(mode,), timeout=120))


def test_groups_from_a_device_mesh(ranks: list[RankResult]) -> None:
    assert_ok(ranks)


@pytest.mark.parametrize("how", ["float64", "converted"])
def test_the_models_dtype_is_kept(how: str, ranks: list[RankResult]) -> None:
    """No policy: masters, gradients, optimizer states and compute in the model's dtype; ``.double()`` after wrapping
    converts them (float64 against one process to 1e-12; a bfloat16 model's dtypes checked exactly)."""
    out = assert_ok(ranks)
    assert out.count("float64: max") == 14 or out.count("double: max") == 5, out[-2000:]


@pytest.mark.parametrize("shape", [s[0] for s in ACCOUNTING])
def test_memory_and_bytes_equal_the_cost_model(shape: str, ranks: list[RankResult]) -> None:
    assert_ok(ranks)


@pytest.mark.parametrize("case,message", BAD_INPUT, ids=BAD_INPUT_IDS)
def test_bad_input_fails_on_every_rank(case: str, message: str, ranks: list[RankResult]) -> None:
    assert_ok(ranks)
    assert any(message in r.output for r in ranks), [r.output[-500:] for r in ranks]
    for r in ranks:
        assert "Error" in r.output, r.output[-500:]


def test_groups_must_match_the_torchrun_layout() -> None:
    """6 ranks as 2 torchrun nodes of 3: groups of 2 would straddle the nodes, and every rank says so."""
    results = launch("engine_errors.py", 6, env={"LOCAL_WORLD_SIZE": "3"}, args=("layout",), timeout=120)
    assert_ok(results)
    for r in results:
        assert "does not match torchrun's layout of 3 ranks per node" in r.output, r.output[-500:]


def test_auto_measures_chooses_and_agrees(ranks: list[RankResult]) -> None:
    assert_ok(ranks)


def test_activation_checkpointing_keeps_units_sharded_in_backward(ranks: list[RankResult]) -> None:
    """GGG: the peak of unsharded units in backward with checkpointing (reentrant or not, early stop on or off) is
    at most that without it (root + computing + prefetched = 3 of 7 units)."""
    assert_ok(ranks)


def test_modules_on_the_same_groups_share_communicators_and_train_together(ranks: list[RankResult]) -> None:
    """An encoder and a decoder wrapped apart, one loss: one process's parameters (1e-5), no new process groups."""
    assert_ok(ranks)
