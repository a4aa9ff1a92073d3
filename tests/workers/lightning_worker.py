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
  fp16_mixed: "16-mixed" (Lightning's MixedPrecision plugin, given explicitly: on the CPU accelerator Lightning turns
          precision="16-mixed" into bf16) on paro_III with an inf put into rank 0's gradient shard only, at step 2:
          the ShardedGradScaler skips that step and halves the scale on every rank, as DDP with the inf on every
          rank; a plain GradScaler in its place skips in rank 0's group only (torch's DTensor reduces its found-inf
          flag over the mesh dimensions the gradients are sharded on: the group, for III's optimizer states)
  ema_swap: a callback that copies an EMA of the weights into the parameters in place for each validation and
          copies them back after (4 validations): paro_IIG's validation losses and parameters equal DDP's
"""

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
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


def data(seed: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
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


class InfInShard(L.Callback):
    """Puts an inf into the first gradient element of ``ranks``' shards after the backward that ends optimizer step 2
    (its gradients synced; the scaler unscales and checks them next), as an fp16 overflow in one shard shows."""

    def __init__(self, ranks: set[int]) -> None:
        self.ranks, self.batch_idx, self.placed = ranks, -1, 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, i: int) -> None:
        self.batch_idx = i

    @torch.no_grad()
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != 1 or self.batch_idx % ACCUM != ACCUM - 1 or RANK not in self.ranks:
            return
        for group in trainer.optimizers[0].param_groups:
            for p in group["params"]:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if local is not None and local.numel() > 0:
                    local.view(-1)[0] = float("inf")
                    self.placed += 1
                    return


def fit_fp16(strategy: str, inf_ranks: set[int], plain_scaler: bool = False) -> tuple[L.Trainer, Classifier, float]:
    """A fit under Lightning's "16-mixed" plugin with an inf in ``inf_ranks``' gradients at step 2; with
    ``plain_scaler`` the plugin's scaler is replaced by a plain GradScaler after the strategy set it up."""
    L.seed_everything(0, verbose=False)
    module, inf = Classifier(), InfInShard(inf_ranks)
    t = trainer(strategy, plugins=[MixedPrecision("16-mixed", "cpu")], callbacks=[inf])
    if plain_scaler:
        t.strategy.precision_plugin.scaler = torch.amp.GradScaler("cpu")
    t.fit(module, data())
    assert inf.placed == (RANK in inf_ranks), inf.placed
    return t, module, t.strategy.precision_plugin.scaler.get_scale()


def every_rank(value: float) -> list[float]:
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(WORLD)]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64))
    return [v.item() for v in values]


def check_fp16_mixed(out: Path) -> None:
    plugin = ParoStrategy("IIG", precision_plugin=MixedPrecision("16-mixed", "cpu")).precision_plugin
    assert isinstance(plugin.scaler, ShardedGradScaler), plugin.scaler
    init, skipped = plugin.scaler.get_scale(), plugin.scaler.get_scale() * plugin.scaler.get_backoff_factor()
    ref_t, ref_m, ref_scale = fit_fp16("ddp", set(range(WORLD)))  # every rank overflows: DDP skips the step
    assert every_rank(ref_scale) == [skipped] * WORLD, every_rank(ref_scale)
    want = params(ref_t, ref_m)
    t, module, scale = fit_fp16("paro_III", {0})
    assert isinstance(t.strategy.precision_plugin.scaler, ShardedGradScaler), t.strategy.precision_plugin.scaler
    scales = every_rank(scale)
    assert scales == [skipped] * WORLD, f"an inf in rank 0's shard: scales {scales} (DDP: {skipped}, from {init})"
    diff = worst(params(t, module), want)
    assert diff < TOL, f"16-mixed on paro_III differs from DDP (the step skipped everywhere) by {diff:.3g}"
    # the check can fail: a plain GradScaler sees rank 0's inf in rank 0's group only (ranks 0 and 1)
    t, module, scale = fit_fp16("paro_III", {0}, plain_scaler=True)
    plain = every_rank(scale)
    off = worst(params(t, module), want)
    assert plain == [skipped] * 2 + [init] * (WORLD - 2) and off > 100 * TOL, (plain, off)
    report("fp16_mixed", f"scales {scales} on every rank as DDP's, max |diff| {diff:.2e}; a plain GradScaler: "
           f"scales {plain}, parameters off by {off:.2e}")  # fmt: skip


class EMASwap(L.Callback):
    """An EMA of the weights, copied into the parameters for each validation and back after, in place as users do.

    Under ParoStrategy the parameters are this rank's shards (DTensors), and so are the EMA and the backup.
    """

    def __init__(self, decay: float = 0.5) -> None:
        self.decay = decay
        self.ema: list[torch.Tensor] = []
        self.backup: list[torch.Tensor] = []
        self.val_losses: list[float] = []
        self.gaps: list[float] = []
        """Per validation: max |EMA - weights| on this rank's part."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.ema = [p.detach().clone() for p in pl_module.parameters()]

    @torch.no_grad()
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        for e, p in zip(self.ema, pl_module.parameters(), strict=True):
            e.lerp_(p, 1 - self.decay)

    @torch.no_grad()
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.backup = [p.detach().clone() for p in pl_module.parameters()]
        gaps = [e - p for e, p in zip(self.ema, self.backup, strict=True)]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in gaps]
        self.gaps.append(max(x.abs().max().item() for x in local if x.numel()))
        for p, e in zip(pl_module.parameters(), self.ema, strict=True):
            p.data.copy_(e)

    @torch.no_grad()
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val_losses.append(trainer.callback_metrics["val_loss"].item())
        for p, b in zip(pl_module.parameters(), self.backup, strict=True):
            p.copy_(b)


def check_ema_swap(out: Path) -> None:
    runs = []
    for strategy in ("ddp", "paro_IIG"):
        L.seed_everything(0, verbose=False)
        module, ema = Classifier(), EMASwap()
        t = trainer(strategy, callbacks=[ema], val_check_interval=ACCUM, num_sanity_val_steps=1)
        t.fit(module, data(), data(seed=2))
        runs.append((params(t, module), ema))
    (want, ref), (got, ema) = runs
    validations = 2 * EPOCHS  # after each optimizer step
    assert len(ref.val_losses) == len(ema.val_losses) == validations, (ref.val_losses, ema.val_losses)
    assert min(ref.gaps[1:]) > 100 * TOL, f"the EMA must differ from the weights it replaces: {ref.gaps}"
    off = max(abs(a - b) for a, b in zip(ema.val_losses, ref.val_losses, strict=True))
    assert off < TOL, f"validation losses with the EMA swapped in: {ema.val_losses} against DDP's {ref.val_losses}"
    diff = worst(got, want)
    assert diff < TOL, f"after EMA swaps around validation, paro_IIG differs from DDP by {diff:.3g}"
    report("ema_swap", f"{validations} validation losses {[round(v, 4) for v in ema.val_losses]} within {off:.2e} of "
           f"DDP's (EMA-weights gap >= {min(ref.gaps[1:]):.2e}), parameters {diff:.2e}")  # fmt: skip


CHECKS = {
    "train": check_train,
    "resume": check_resume,
    "errors": check_errors,
    "lifecycle": check_lifecycle,
    "empty_init": check_empty_init,
    "bf16_mixed": check_bf16_mixed,
    "fp16_mixed": check_fp16_mixed,
    "ema_swap": check_ema_swap,
}


def main() -> None:
    out, checks = Path(sys.argv[1]), sys.argv[2].split(",")
    for name in checks:
        CHECKS[name](out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
