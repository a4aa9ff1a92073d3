"""ParoStrategy under torchrun (4 CPU ranks, PARO_GROUP_SIZE=2): Lightning training equals Lightning's DDP strategy.

Usage: lightning_worker.py OUT_DIR CHECK[,CHECK...]; each check prints "CHECK <name> ok: ..." on rank 0.
  train:  "paro" (auto), "paro_IIG" and ParoStrategy("GGG") against "ddp", 2 epochs of 2 optimizer steps:
          accumulation 2, clipping, a StepLR scheduler, AdamW with two param groups by name; parameters within 1e-5
  resume: paro_IIG for 1 epoch, trainer.save_checkpoint, then ParoStrategy("GGG") resumes with ckpt_path= for the
          second: equal to the 2-epoch DDP run; the consolidated export holds the same weights
  errors: an unknown strategy code and a group size that does not divide fail on every rank with a clear message
  lifecycle: paro_IIG's fit, then validate, test and predict with the same Trainer and module, and the
          LightningModule's own state_dict(): equal to DDP's; a second fit continues from the first
  empty_init: a module built under trainer.init_module(empty_init=True), fit on paro_IIG: equal to DDP from the
          same initial weights (read when the fit starts)
  bf16_mixed: precision="bf16-mixed" on paro_IIG against DDP
"""

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
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

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

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


def fit(
    strategy: object, epochs: int = EPOCHS, ckpt_path: str | None = None, **kw: object
) -> tuple[L.Trainer, Classifier]:
    L.seed_everything(0, verbose=False)
    module = Classifier()
    t = trainer(strategy, epochs, **kw)
    t.fit(module, data(), ckpt_path=ckpt_path)
    return t, module


def whole(state: dict) -> dict[str, torch.Tensor]:
    """A state dict's values as whole tensors (DTensors gathered by torch's own redistribution)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def evaluate(t: L.Trainer, module: Classifier) -> tuple[float, float, torch.Tensor]:
    val = t.validate(module, data(), verbose=False)[0]["val_loss"]
    test = t.test(module, data(), verbose=False)[0]["test_loss"]
    preds = torch.cat(t.predict(module, data()))
    return val, test, preds


def params(t: L.Trainer, module: Classifier) -> dict[str, torch.Tensor]:
    model = t.strategy.model
    if isinstance(model, paro_torch.ParoShardedModule):
        return model.full_state_dict()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


_ddp_run: list[dict[str, torch.Tensor]] = []


def ddp_params() -> dict[str, torch.Tensor]:
    """The parameters of ``fit("ddp")`` (seeded: the same run every time), trained once per process."""
    if not _ddp_run:
        _ddp_run.append(params(*fit("ddp")))
    return _ddp_run[0]


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def report(name: str, text: str) -> None:
    if RANK == 0:
        print(f"CHECK {name} ok: {text}", flush=True)


def check_train(out: Path) -> None:
    want = ddp_params()
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
    want = ddp_params()
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


def check_lifecycle(out: Path) -> None:
    ref_t, ref_m = fit("ddp")
    want = params(ref_t, ref_m)
    want_eval = evaluate(ref_t, ref_m)
    t, module = fit("paro_IIG")
    got_eval = evaluate(t, module)  # after fit's teardown, with the same Trainer
    off = max(abs(got_eval[0] - want_eval[0]), abs(got_eval[1] - want_eval[1]))
    off_pred = (got_eval[2] - want_eval[2]).abs().max().item()
    assert off < TOL and off_pred < TOL, f"validate/test losses {off:.3g}, predictions {off_pred:.3g} from DDP's"
    diff = worst(whole(module.state_dict()), want)
    assert diff < TOL, f"the LightningModule's state_dict() (its DTensors, whole) differs from DDP's by {diff:.3g}"
    ref_t2 = trainer("ddp", 2 * EPOCHS)  # a second fit of the same module continues the first
    ref_t2.fit(ref_m, data())
    t2 = trainer("paro_IIG", 2 * EPOCHS)
    t2.fit(module, data())
    again = worst(params(t2, module), params(ref_t2, ref_m))
    assert again < 10 * TOL, f"a second fit of the fitted module differs from DDP's by {again:.3g}"
    report("lifecycle", f"validate, test, predict, state_dict() after fit: {max(off, off_pred, diff):.2e}; "
           f"second fit {again:.2e}")  # fmt: skip


class InitialWeights(L.Callback):
    """The wrapped model's whole weights when the fit starts (after meta-device materialisation)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = trainer.strategy.model.full_state_dict()


def check_empty_init(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    grab = InitialWeights()
    t = trainer("paro_IIG", callbacks=[grab])
    with t.init_module(empty_init=True):
        module = Classifier()
    assert all(p.is_meta for p in module.parameters())
    t.fit(module, data())
    init = grab.weights  # reset_parameters() ran on every module: LayerNorm ones and zeros, Linear random
    norms = {k: v for k, v in init.items() if ".norm." in k}
    assert norms and all(torch.equal(v, torch.ones_like(v) if k.endswith("weight") else torch.zeros_like(v))
                         for k, v in norms.items()), "LayerNorms not initialised"  # fmt: skip
    assert all(v.std() > 0.01 for k, v in init.items() if k not in norms), "Linear layers not initialised"
    ref = Classifier()
    ref.load_state_dict(grab.weights)
    ref_t = trainer("ddp")
    ref_t.fit(ref, data())
    diff = worst(params(t, module), params(ref_t, ref))
    assert diff < TOL, f"empty_init=True on paro_IIG differs from DDP from the same start by {diff:.3g}"
    report("empty_init", f"max |diff| {diff:.2e} against DDP from the same initial weights")


def check_bf16_mixed(out: Path) -> None:
    ref_t, ref_m = fit("ddp", precision="bf16-mixed")
    t, module = fit("paro_IIG", precision="bf16-mixed")
    diff = worst(params(t, module), params(ref_t, ref_m))
    moved = worst(params(ref_t, ref_m), ddp_params())  # the precision changes the result
    assert diff < TOL < moved / 100, f"bf16-mixed on paro_IIG differs from DDP by {diff:.3g} (bf16 moves {moved:.3g})"
    report("bf16_mixed", f"max |diff| {diff:.2e} against DDP (bf16 against fp32: {moved:.2e})")


CHECKS = {
    "train": check_train,
    "resume": check_resume,
    "errors": check_errors,
    "lifecycle": check_lifecycle,
    "empty_init": check_empty_init,
    "bf16_mixed": check_bf16_mixed,
}


def main() -> None:
    out, checks = Path(sys.argv[1]), sys.argv[2].split(",")
    for name in checks:
        CHECKS[name](out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
