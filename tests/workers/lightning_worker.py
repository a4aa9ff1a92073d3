"""ParoStrategy under torchrun (4 CPU ranks, PARO_GROUP_SIZE=2): Lightning training equals Lightning's DDP strategy.

Usage: lightning_worker.py OUT_DIR CHECK[,CHECK...]; each check prints "CHECK <name> ok: ..." on rank 0.
  train:  "paro" (auto), "paro_IIG" and ParoStrategy("GGG") against "ddp", 2 epochs of 2 optimizer steps:
          accumulation 2, clipping, a StepLR scheduler, AdamW with two param groups by name; parameters within 1e-5
  resume: paro_IIG for 1 epoch, trainer.save_checkpoint, then ParoStrategy("GGG") resumes with ckpt_path= for the
          second: equal to the 2-epoch DDP run; the consolidated export holds the same weights
  errors: an unknown strategy code and a group size that does not divide fail on every rank with a clear message
"""

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paro_torch
from paro_torch.lightning import ParoStrategy

EPOCHS, STEPS, ACCUM, BATCH, DIM, CLASSES, TOL = 2, 4, 2, 4, 16, 5, 1e-5  # STEPS over all epochs
WORLD = int(os.environ["WORLD_SIZE"])
RANK = int(os.environ["RANK"])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.norm(x)))


class Classifier(L.LightningModule):
    """An ordinary LightningModule: nothing in it knows about PaRO."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> dict:
        decay = [p for n, p in self.named_parameters() if n.endswith("weight") and "norm" not in n]
        rest = [p for n, p in self.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
        assert decay and rest, "param groups by the module's own names"
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    n = STEPS // EPOCHS * ACCUM * BATCH * WORLD  # one epoch
    ds = TensorDataset(torch.randn(n, DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
    return DataLoader(ds, batch_size=BATCH, shuffle=False)  # Lightning adds a DistributedSampler


def trainer(strategy: object, epochs: int = EPOCHS, **kw: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=0.05,  # small: every step clips
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def fit(strategy: object, epochs: int = EPOCHS, ckpt_path: str | None = None) -> tuple[L.Trainer, Classifier]:
    L.seed_everything(0, verbose=False)
    module = Classifier()
    t = trainer(strategy, epochs)
    t.fit(module, data(), ckpt_path=ckpt_path)
    return t, module


def params(t: L.Trainer, module: Classifier) -> dict[str, torch.Tensor]:
    model = t.strategy.model
    if isinstance(model, paro_torch.ParoShardedModule):
        return model.full_state_dict()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def report(name: str, text: str) -> None:
    if RANK == 0:
        print(f"CHECK {name} ok: {text}", flush=True)


def check_train(out: Path) -> None:
    ref_trainer, ref_module = fit("ddp")
    want = params(ref_trainer, ref_module)
    start = params(*fit("ddp", epochs=EPOCHS - 1))  # the check can fail: the last epoch moves far more than TOL
    assert worst(start, want) > 100 * TOL
    done = []
    # one "token" per sample here; the model's own forward and backward timed on one batch
    timed = ParoStrategy("auto", group_size=2, tokens_per_micro_step=BATCH, example_inputs=torch.randn(BATCH, DIM))
    for strategy in ("paro", "paro_IIG", ParoStrategy("GGG", group_size=2), timed):
        t, module = fit(strategy)
        model = t.strategy.model
        assert isinstance(model, paro_torch.ParoShardedModule), type(model)
        assert t.global_step == STEPS, t.global_step
        diff = worst(params(t, module), want)
        assert diff < TOL, f"{strategy} ({model.strategy.code}) differs from Lightning's DDP by {diff:.3g}"
        lr = t.optimizers[0].param_groups[0]["lr"]
        assert abs(lr - 1e-2 * 0.7**STEPS) < 1e-12, lr
        done.append(f"{getattr(strategy, 'paro_strategy', strategy)}->{model.strategy.code} {diff:.2e}")
        if model.plan is not None:  # auto: the predicted step has compute exactly when the tokens are known
            step = next(s["step"] for s in model.plan["strategies"] if s["code"] == model.strategy.code)
            assert (step["compute_s"] > 0) == (strategy is timed), (strategy, step)
            assert model.links is not None and (model.links.compute_probe == "model") == (strategy is timed)
    report("train", ", ".join(done))


def check_resume(out: Path) -> None:
    ref_trainer, ref_module = fit("ddp")
    want = params(ref_trainer, ref_module)
    first, _ = fit("paro_IIG", epochs=1)
    ckpt = out / "half.ckpt"
    first.save_checkpoint(ckpt)
    assert ckpt.is_dir() and (ckpt / "paro.json").is_file(), "a sharded checkpoint directory"
    t, module = fit(ParoStrategy("GGG", group_size=2), ckpt_path=str(ckpt))
    assert t.global_step == STEPS, t.global_step
    got = params(t, module)
    diff = worst(got, want)
    assert diff < TOL, f"IIG -> checkpoint -> GGG differs from the uninterrupted DDP run by {diff:.3g}"
    t.strategy.save_consolidated(out / "final.safetensors")
    if RANK == 0:
        from safetensors.torch import load_file

        exported = load_file(out / "final.safetensors")
        assert exported.keys() == got.keys() and all(torch.equal(exported[k], got[k]) for k in got)
    dist.barrier()
    report("resume", f"paro_IIG 1 epoch -> save -> ParoStrategy('GGG') 1 more: max |diff| {diff:.2e} against DDP")


def check_errors(out: Path) -> None:
    messages = []
    try:
        ParoStrategy("XYZ")
        raise AssertionError("an unknown strategy code was accepted")
    except paro_torch.InvalidStrategyError as e:
        messages.append(str(e))
    try:
        fit(ParoStrategy("IIG", group_size=3))
        raise AssertionError("a group size of 3 on 4 ranks was accepted")
    except paro_torch.TopologyError as e:
        assert "not divisible by group size 3" in str(e), e
        messages.append(str(e))
    report("errors", " | ".join(m.splitlines()[0][:100] for m in messages))


CHECKS = {"train": check_train, "resume": check_resume, "errors": check_errors}


def main() -> None:
    out, checks = Path(sys.argv[1]), sys.argv[2].split(",")
    for name in checks:
        CHECKS[name](out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
