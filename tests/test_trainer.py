"""ParoTrainer: the Hugging Face Trainer on ParoShardedModule, under torchrun with 4 CPU ranks (2 groups of 2).

One torchrun launch runs every check of workers/hf_trainer.py (start-up dominates on 2 cores); each test below
reads its check's result. Every check compares numbers with a single-process plain-torch run or with another run.
"""

import importlib.util

import pytest
from launch import assert_check, rank0_errors, torchrun_checks

pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

HAS_SCHEDULEFREE = importlib.util.find_spec("schedulefree") is not None
CHECKS = ("full", "resume", "lora", "auto", "defaults", *(("schedule_free",) if HAS_SCHEDULEFREE else ()))


@pytest.fixture(scope="module")
def torchrun_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    env = {"PARO_GROUP_SIZE": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return torchrun_checks("hf_trainer.py", tmp_path_factory.mktemp("hf_trainer"), CHECKS, env)


def test_matches_single_process_training_and_saves_a_pretrained_model(torchrun_output: str) -> None:
    """IIG, gradient accumulation 2, clipping, weight decay: losses, grad norms, learning rates, parameters and the
    eval loss equal one process over the same global batches (1e-5); save_model loads with from_pretrained."""
    assert_check(torchrun_output, "full")


def test_resume_from_checkpoint_continues_the_same_run(torchrun_output: str) -> None:
    """6 steps straight vs 3 steps + resume_from_checkpoint for 3 more (into GGG): same losses, eval losses and
    parameters; load_best_model_at_end goes back to the best sharded checkpoint."""
    assert_check(torchrun_output, "resume")


def test_lora_trains_only_the_adapters_like_one_process(torchrun_output: str) -> None:
    assert_check(torchrun_output, "lora")


def test_auto_strategy_with_bf16_and_tied_embeddings(torchrun_output: str) -> None:
    assert_check(torchrun_output, "auto")


def test_trainer_defaults_fused_adamw_and_activation_checkpointing(torchrun_output: str) -> None:
    """The Trainer's default optimizer (fused AdamW), weight decay 0 and max_grad_norm 1.0, in "auto", IIG and NNG with
    activation checkpointing (recomputing) and in GGG without: losses, grad norms, learning rates and parameters equal
    one process (1e-5), where one stale parameter sync would leave them off by more than 1e-3."""
    assert_check(torchrun_output, "defaults")


@pytest.mark.skipif(not HAS_SCHEDULEFREE, reason="needs the schedulefree package")
def test_schedule_free_with_evaluations_matches_the_stock_trainer_on_ddp(torchrun_output: str) -> None:
    """optim="schedule_free_adamw", whose optimizer.eval()/train() rewrite the parameters in place around each
    evaluation, with an evaluation every 2 steps: IIG's losses, eval losses and parameters equal the stock Trainer's
    on DDP (1e-5)."""
    assert_check(torchrun_output, "schedule_free")


def test_every_rank_exits_cleanly(torchrun_output: str) -> None:
    assert torchrun_output.startswith("torchrun exited 0\n"), rank0_errors(torchrun_output)
