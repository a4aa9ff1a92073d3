"""ParoStrategy: PyTorch Lightning's Trainer on ParoShardedModule, under torchrun with 4 CPU ranks (2 groups of 2).

One torchrun launch runs every check of workers/lightning_worker.py (start-up dominates on 2 cores); each test reads
its check's result. Every check compares parameters with Lightning's own DDP strategy over the same data.
"""

import pytest
import torch
from launch import assert_check, rank0_errors, torchrun_checks

pytest.importorskip("lightning")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

CHECKS = ("train", "resume", "errors", "lifecycle", "empty_init", "bf16_mixed", "fp16_mixed", "ema_swap")


@pytest.fixture(scope="module")
def torchrun_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("lightning")
    return torchrun_checks("lightning_worker.py", out, CHECKS, {"PARO_GROUP_SIZE": "2"})


def test_paro_strategies_train_like_lightning_ddp(torchrun_output: str) -> None:
    """strategy="paro" (auto), "paro_IIG" and ParoStrategy("GGG"): 2 epochs with accumulation, clipping, an LR
    scheduler and param groups by name end with Lightning DDP's parameters (1e-5)."""
    assert_check(torchrun_output, "train")


def test_checkpoint_resumes_into_another_strategy(torchrun_output: str) -> None:
    """IIG for one epoch, trainer.save_checkpoint (sharded), then GGG with ckpt_path= for the second: DDP's result;
    save_consolidated writes the same weights as one file."""
    assert_check(torchrun_output, "resume")


def test_bad_arguments_fail_on_every_rank(torchrun_output: str) -> None:
    """An unknown strategy code and a group size that does not divide the world raise on every rank, clearly."""
    assert_check(torchrun_output, "errors")


def test_every_rank_exits_cleanly(torchrun_output: str) -> None:
    """Each rank runs every check itself (a rank that did not raise would fail): all exit 0."""
    assert torchrun_output.startswith("torchrun exited 0\n"), rank0_errors(torchrun_output)


def test_evaluation_after_fit_and_a_second_fit(torchrun_output: str) -> None:
    """validate, test and predict after fit, the LightningModule's state_dict(), a second fit: as DDP's."""
    assert_check(torchrun_output, "lifecycle")


def test_empty_init_trains_like_ddp(torchrun_output: str) -> None:
    """trainer.init_module(empty_init=True): materialised while sharded, then DDP's training from that start."""
    assert_check(torchrun_output, "empty_init")


def test_bf16_mixed_trains_like_ddp(torchrun_output: str) -> None:
    assert_check(torchrun_output, "bf16_mixed")


def test_16_mixed_gets_a_sharded_grad_scaler() -> None:
    """Lightning's "16-mixed" plugin, as the Trainer hands it to the strategy, carries a ShardedGradScaler over the
    default process group (the world) with the plugin's own scaler settings; "bf16-mixed" has no scaler. In-process:
    nothing is launched."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from paro_torch.lightning import ParoStrategy

    mine = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=7)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=mine)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ParoStrategy("IIG"), plugins=[plugin], logger=False)
    assert trainer.precision_plugin is plugin
    scaler = plugin.scaler
    assert isinstance(scaler, ShardedGradScaler) and scaler.process_group is None, scaler
    assert (scaler.get_scale(), scaler.get_growth_interval(), scaler.is_enabled()) == (8.0, 7, True)
    assert ParoStrategy(precision_plugin=MixedPrecision("bf16-mixed", "cpu")).precision_plugin.scaler is None


def test_16_mixed_skips_an_overflow_on_every_rank(torchrun_output: str) -> None:
    """precision "16-mixed" on paro_III with an inf in rank 0's gradient shard only: every rank skips that step and
    halves its scale, as DDP does when every rank overflows (1e-5); a plain GradScaler skips in rank 0's group only."""
    assert_check(torchrun_output, "fp16_mixed")


def test_ema_swapped_in_for_validation_matches_ddp(torchrun_output: str) -> None:
    """A callback copies an EMA of the weights into the (sharded) parameters in place for each of 4 validations and
    copies them back after: validation losses and final parameters equal DDP's (1e-5)."""
    assert_check(torchrun_output, "ema_swap")
