"""ParoTrainer (Hugging Face Trainer + ParoShardedModule) on a small random LlamaForCausalLM, compared with plain torch.

Usage (torchrun or tests/launch.py, 4 ranks, PARO_GROUP_SIZE=2): hf_trainer.py OUT_DIR CHECK[,CHECK...]
CHECK in
  full    IIG, 2 micro-steps, clipping, weight decay: losses, grad norms, learning rates, parameters and the eval loss
          equal a single-process loop over the same global batches; save_model loads with from_pretrained
  resume  6 steps vs 3 steps + resume_from_checkpoint (into GGG) for 3 more, with evaluations: same losses and
          parameters; load_best_model_at_end goes back to the best checkpoint
  lora    a PEFT LoRA model (adapters trainable only) equals its reference; the saved adapter loads with peft
  auto    strategy="auto" with bf16 on tied embeddings: a strategy is chosen, training stays near the fp32 reference,
          the saved model loads tied
  defaults  the Trainer's defaults for optim (fused AdamW), weight_decay (0) and max_grad_norm (1.0), in "auto" and
          IIG with activation checkpointing on and NNG with it off: losses, grad norms, learning rates and parameters
          equal the single-process reference (1e-5); checkpointing is on in the model and recomputes
  schedule_free  optim="schedule_free_adamw" (its optimizer.eval()/train() rewrite the parameters in place around
          each evaluation) with an evaluation every 2 steps, IIG against the stock Trainer on DDP: losses, eval losses
          and parameters within 1e-5
Rank 0 prints "CHECK <name> ok ..." after each check passes.
"""

import os
import sys
import time
from functools import partial
from itertools import pairwise

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, get_scheduler
from transformers.utils import logging as hf_logging

import paro_torch
from paro_torch.trainer import PARO_CHECKPOINT_DIR, ParoTrainer

CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
SEQ, PER_DEVICE, ACCUM = 16, 2, 2
WORLD, RANK = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])  # the Trainer starts torch.distributed


class Tokens(Dataset):
    """Fixed random token ids; the labels are the inputs (the model shifts them)."""

    def __init__(self, n: int, seed: int = 1) -> None:
        self.ids = torch.randint(0, CONFIG["vocab_size"], (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def make_model(**config) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**CONFIG, **config}))


def make_lora() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = make_model()
    torch.manual_seed(2)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B starts at zero; make both adapter matrices matter from the first step
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return lora


HF_DEFAULT = object()
"""``arguments(..., name=HF_DEFAULT)``: leave ``name`` at the ``TrainingArguments`` default instead of this file's."""


def arguments(out: str, steps: int, **kw) -> TrainingArguments:
    defaults = dict(
        output_dir=out,
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUM,
        max_steps=steps,
        learning_rate=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        warmup_steps=0,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    defaults.update(kw)
    return TrainingArguments(**{k: v for k, v in defaults.items() if v is not HF_DEFAULT})


def logged(trainer: Trainer, key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


def reference(
    make, args: TrainingArguments, data: Tokens, states: list[dict[str, torch.Tensor]] | None = None
) -> tuple[torch.nn.Module, list[float], ...]:
    """The same training in one process: each step one global batch (PER_DEVICE x world x ACCUM sequences).

    Returns the model and, per step, the loss, the gradient norm before clipping and the learning rate; appends the
    parameters before the first step and after each step to ``states`` if given.
    """
    model = make()
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    opt = cls(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        **kwargs,
    )
    warmup = args.get_warmup_steps(args.max_steps)
    sched = get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=warmup, num_training_steps=args.max_steps)
    batch = PER_DEVICE * WORLD * ACCUM
    losses, norms, lrs = [], [], []
    if states is not None:
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    for s in range(args.max_steps):
        ids = data.ids[s * batch : (s + 1) * batch]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_([p for _, p in named], args.max_grad_norm).item())
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if states is not None:
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return model, losses, norms, lrs


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float, what: str) -> float:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want))[:5])
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    assert worst < tol, f"{what}: parameters differ by {worst:.3g} (tolerance {tol})"
    return worst


def report(name: str, message: str) -> None:
    if RANK == 0:
        print(f"CHECK {name} ok: {message}", flush=True)


def check_full(out: str) -> None:
    steps = 4
    data, held_out = Tokens(steps * PER_DEVICE * WORLD * ACCUM), Tokens(4 * WORLD, seed=3)
    args = arguments(f"{out}/full", steps, per_device_eval_batch_size=4)
    trainer = ParoTrainer(model=make_model(), args=args, train_dataset=data, strategy="IIG")
    assert trainer.model.strategy.code == "IIG" and trainer.model.groups.group_size == 2
    initial = trainer.model.full_state_dict()
    trainer.train()
    # accelerate neither wrapped the model (DDP) nor patched its forward (autocast)
    assert trainer.model_wrapped is trainer.model and "_original_forward" not in vars(trainer.model)
    ref, ref_losses, ref_norms, ref_lrs = reference(make_model, args, data)
    assert min(ref_norms) > args.max_grad_norm, f"the test must clip: {ref_norms}"
    losses, norms, lrs = logged(trainer, "loss"), logged(trainer, "grad_norm"), logged(trainer, "learning_rate")
    assert sorted(losses) == sorted(norms) == sorted(lrs) == list(range(1, steps + 1)), trainer.state.log_history
    for s in range(steps):
        assert abs(losses[s + 1] - ref_losses[s]) < 1e-5, ("loss", s, losses, ref_losses)
        assert abs(norms[s + 1] - ref_norms[s]) < 1e-5 * ref_norms[s], ("grad norm", s, norms, ref_norms)
        assert abs(lrs[s + 1] - ref_lrs[s]) < 1e-12, ("learning rate", s, lrs, ref_lrs)
    got = trainer.model.full_state_dict()
    worst = close(got, ref.state_dict(), 1e-5, "IIG vs one process")
    moved = max((got[k] - initial[k]).abs().max().item() for k in got)
    assert moved > 100 * 1e-5, f"training barely moved the parameters ({moved:.3g})"
    metrics = trainer.evaluate(held_out)  # forward through the sharded model, no grad
    with torch.no_grad():
        want_eval = ref(input_ids=held_out.ids, labels=held_out.ids).loss.item()
    assert abs(metrics["eval_loss"] - want_eval) < 1e-5, (metrics, want_eval)
    trainer.save_model(f"{out}/full/final")  # every rank: the gather is collective
    if RANK == 0:
        loaded, info = LlamaForCausalLM.from_pretrained(f"{out}/full/final", output_loading_info=True)
        assert not any(info.values()), info
        assert loaded.state_dict().keys() == got.keys()
        assert all(torch.equal(v, got[k]) for k, v in loaded.state_dict().items()), "saved model != trained"
    dist.barrier()
    report("full", f"losses {[round(v, 4) for v in losses.values()]}, moved {moved:.2e}, max |param diff| {worst:.2e}")


class FirstIsBest:
    """compute_metrics under which the earliest evaluation scores best: load_best_model_at_end must go back to it."""

    trainer: Trainer | None = None

    def __call__(self, _: object) -> dict[str, float]:
        assert self.trainer is not None
        return {"first": -float(self.trainer.state.global_step)}


def run_with_checkpoints(out: str, steps: int, strategy: str, data: Tokens, resume: str | None = None) -> Trainer:
    """Random sampling, a checkpoint and an evaluation every 3 steps, the best (first) model loaded at the end."""
    every_3 = dict(save_strategy="steps", save_steps=3, eval_strategy="steps", eval_steps=3)
    best = dict(load_best_model_at_end=True, metric_for_best_model="first", greater_is_better=True)
    args = arguments(out, steps, train_sampling_strategy="random", **every_3, **best)
    metrics = FirstIsBest()
    held_out = Tokens(2 * WORLD, seed=3)
    trainer = ParoTrainer(
        model=make_model(),
        args=args,
        train_dataset=data,
        eval_dataset=held_out,
        compute_metrics=metrics,
        strategy=strategy,
    )
    metrics.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def check_resume(out: str) -> None:
    from safetensors.torch import load_file

    steps = 6
    data = Tokens(steps * PER_DEVICE * WORLD * ACCUM)
    straight = run_with_checkpoints(f"{out}/straight", steps, "IIG", data)
    ckpt = f"{out}/straight/checkpoint-3"
    files = set(os.listdir(ckpt))
    for name in ("model.safetensors", "scheduler.pt", "trainer_state.json", f"rng_state_{RANK}.pth"):
        assert name in files, (name, files)
    assert "optimizer.pt" not in files and os.path.isfile(f"{ckpt}/{PARO_CHECKPOINT_DIR}/paro.json"), files
    # 3 more steps from the checkpoint, in another strategy: the sharded checkpoint reshards
    resumed = run_with_checkpoints(f"{out}/resumed", steps, "GGG", data, resume=ckpt)
    a, b = logged(straight, "loss"), logged(resumed, "loss")
    assert sorted(a) == sorted(b) == list(range(1, steps + 1)), (a, b)
    for s in range(4, steps + 1):  # steps 1-3 of the resumed run come from trainer_state.json
        assert abs(a[s] - b[s]) < 1e-5, ("loss", s, a, b)
    assert logged(straight, "learning_rate") == logged(resumed, "learning_rate")
    ea, eb = logged(straight, "eval_loss"), logged(resumed, "eval_loss")
    assert sorted(ea) == sorted(eb) == [3, 6] and abs(ea[6] - eb[6]) < 1e-5, (ea, eb)
    at_6 = [load_file(f"{out}/{run}/checkpoint-6/model.safetensors") for run in ("straight", "resumed")]
    worst = close(at_6[1], at_6[0], 1e-5, "step 6: resumed vs straight")
    # load_best_model_at_end went back to step 3 (the sharded checkpoint) in both runs
    best = load_file(f"{ckpt}/model.safetensors")
    assert straight.state.best_model_checkpoint == resumed.state.best_model_checkpoint == ckpt
    for trainer in (straight, resumed):
        got = trainer.model.full_state_dict()
        assert got.keys() == best.keys() and all(torch.equal(got[k], best[k]) for k in best), "not the best model"
    report("resume", f"IIG 3 steps, GGG 3 more: losses {[round(b[s], 4) for s in sorted(b)]}, max |diff| {worst:.2e}")


def check_lora(out: str) -> None:
    from peft import PeftModel

    steps = 3
    data = Tokens(steps * PER_DEVICE * WORLD * ACCUM)
    args = arguments(f"{out}/lora", steps)
    trainer = ParoTrainer(model=make_lora(), args=args, train_dataset=data, strategy="ING")
    trainable = sum(p.numel() for p in make_lora().parameters() if p.requires_grad)
    params = [p for g in trainer.create_optimizer().param_groups for p in g["params"]]
    held = torch.tensor(sum(p.to_local().numel() for p in params))
    dist.all_reduce(held)  # ING: the optimizer holds this rank's rows of each adapter (G), so all ranks hold each once
    assert held.item() == trainable, (trainable, held)
    trainer.train()
    ref, ref_losses, _, _ = reference(make_lora, args, data)
    losses = logged(trainer, "loss")
    assert all(abs(losses[s + 1] - ref_losses[s]) < 1e-5 for s in range(steps)), (losses, ref_losses)
    got = trainer.model.full_state_dict()
    worst = close(got, ref.state_dict(), 1e-5, "LoRA vs one process")
    initial = make_lora().state_dict()
    assert all(torch.equal(v, initial[k]) for k, v in got.items() if "lora_" not in k), "a frozen weight changed"
    assert all(not torch.equal(v, initial[k]) for k, v in got.items() if "lora_" in k), "an adapter did not train"
    trainer.save_model(f"{out}/lora/final")
    if RANK == 0:
        assert os.path.isfile(f"{out}/lora/final/adapter_model.safetensors"), os.listdir(f"{out}/lora/final")
        loaded = PeftModel.from_pretrained(make_model(), f"{out}/lora/final")
        assert all(torch.equal(v, got[k]) for k, v in loaded.state_dict().items()), "saved adapter != trained"
    dist.barrier()
    report("lora", f"{trainable} trainable, losses {[round(v, 4) for v in losses.values()]}, max |diff| {worst:.2e}")


def check_auto(out: str) -> None:
    """strategy="auto" (the default) and bf16, on a model with tied embeddings (one unit holds both names)."""
    steps = 3
    data = Tokens(steps * PER_DEVICE * WORLD * ACCUM)
    args = arguments(f"{out}/auto", steps, bf16=True)
    trainer = ParoTrainer(model=make_model(tie_word_embeddings=True), args=args, train_dataset=data)
    code = trainer.model.strategy.code
    assert code in paro_torch.STRATEGIES and trainer.model.plan is not None, code
    # the Trainer told auto its tokens per micro-step (batch x the dataset's sequence length): compute is predicted
    chosen = next(s for s in trainer.model.plan["strategies"] if s["code"] == code)
    assert chosen["step"]["compute_s"] > 0, chosen["step"]
    # and timed the model itself on the training set's first micro-batch
    assert trainer.model.links is not None and trainer.model.links.compute_probe == "model", trainer.model.links
    assert trainer.model.param_dtype == torch.bfloat16
    trainer.train()
    tied = partial(make_model, tie_word_embeddings=True)
    ref, ref_losses, _, _ = reference(tied, arguments(f"{out}/auto", steps), data)  # float32
    losses = logged(trainer, "loss")
    assert all(abs(losses[s + 1] - ref_losses[s]) < 2e-2 for s in range(steps)), (losses, ref_losses)
    got, want, initial = trainer.model.full_state_dict(), ref.state_dict(), tied().state_dict()
    # bf16 compute perturbs the gradients, and Adam's steps are about lr each: compare whole update vectors
    update = torch.cat([(got[k] - initial[k]).flatten() for k in want])
    want_update = torch.cat([(want[k] - initial[k]).flatten() for k in want])
    error = ((update - want_update).norm() / want_update.norm()).item()
    assert error < 0.2, f"bf16 updates differ from float32 by {error:.2f} of their norm"
    trainer.save_model(f"{out}/auto/final")
    if RANK == 0:
        loaded = LlamaForCausalLM.from_pretrained(f"{out}/auto/final")
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert all(torch.equal(v, got[k]) for k, v in loaded.state_dict().items()), "saved model != trained"
    dist.barrier()
    report("auto", f"chose {code}; bf16 losses {[round(v, 4) for v in losses.values()]}, update error {error:.3f}")


class Calls:
    """A forward pre-hook that counts the module's calls."""

    n = 0

    def __call__(self, *_: object) -> None:
        self.n += 1


def check_defaults(out: str) -> None:
    """The Trainer's own defaults for the optimizer (fused AdamW), weight decay (0) and clipping (1.0), in "auto",
    IIG, NNG (activation checkpointing on) and GGG (off): each run equals the single-process reference."""
    from transformers.training_args import OptimizerNames

    steps, tol = 3, 1e-5
    data = Tokens(steps * PER_DEVICE * WORLD * ACCUM)
    hf = dict(weight_decay=HF_DEFAULT, max_grad_norm=HF_DEFAULT)  # optim: never set by arguments()
    states: list[dict[str, torch.Tensor]] = []
    ref, ref_losses, ref_norms, ref_lrs = reference(make_model, arguments(f"{out}/defaults", steps, **hf), data, states)
    want = ref.state_dict()
    # the check can fail: a parameter sync skipped after any one step leaves parameters off by far more than tol
    step_moves = [max((b[k] - a[k]).abs().max().item() for k in want) for a, b in pairwise(states)]
    assert min(step_moves) > 100 * tol, f"a step barely moves the parameters: {step_moves}"
    done = []
    for strategy, checkpointing in (("auto", True), ("IIG", True), ("NNG", True), ("GGG", False)):
        # NNG through the name most scripts still use (the Trainer maps it to activation_checkpointing)
        flag = "gradient_checkpointing" if strategy == "NNG" else "activation_checkpointing"
        args = arguments(f"{out}/defaults", steps, **hf, **{flag: checkpointing})
        assert args.optim == OptimizerNames.ADAMW_TORCH_FUSED and args.weight_decay == 0.0, (args.optim, args)
        assert args.max_grad_norm == 1.0 and args.activation_checkpointing_kwargs is None, args
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)  # what reference() built too
        assert cls is torch.optim.AdamW and kwargs.get("fused") is True, (cls, kwargs)
        trainer = ParoTrainer(model=make_model(), args=args, train_dataset=data, strategy=strategy)
        code = trainer.model.strategy.code
        assert strategy == "auto" or code == strategy, (strategy, code)
        inner = trainer.model.module
        # calls of a projection in the first decoder layer: once per micro-step, twice with the recomputation
        calls = Calls()
        inner.model.layers[0].self_attn.q_proj.register_forward_pre_hook(calls)
        trainer.train()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
        assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True, optimizer.defaults
        assert inner.is_activation_checkpointing == checkpointing, (strategy, inner.is_activation_checkpointing)
        assert calls.n == steps * ACCUM * (2 if checkpointing else 1), (strategy, calls.n)
        losses, norms, lrs = logged(trainer, "loss"), logged(trainer, "grad_norm"), logged(trainer, "learning_rate")
        assert sorted(losses) == sorted(norms) == sorted(lrs) == list(range(1, steps + 1)), trainer.state.log_history
        for s in range(steps):
            assert abs(losses[s + 1] - ref_losses[s]) < tol, (strategy, "loss", s, losses, ref_losses)
            assert abs(norms[s + 1] - ref_norms[s]) < tol * ref_norms[s], (strategy, "grad norm", s, norms, ref_norms)
            assert abs(lrs[s + 1] - ref_lrs[s]) < 1e-12, (strategy, "learning rate", s, lrs, ref_lrs)
        worst = close(trainer.model.full_state_dict(), want, tol, f"{strategy} ({code}) defaults vs one process")
        done.append(f"{strategy}->{code}{' +ckpt' if checkpointing else ''} {worst:.2e}")
    report(
        "defaults",
        f"fused AdamW, wd 0, clip 1.0 (norms {[round(v, 2) for v in ref_norms]}), min step move "
        f"{min(step_moves):.2e}; losses {[round(v, 4) for v in ref_losses]}; max |param diff| {', '.join(done)}",
    )


def check_schedule_free(out: str) -> None:
    """Schedule-free AdamW with evaluations between steps: ParoTrainer (IIG) equals the stock Trainer on DDP."""
    steps, tol = 4, 1e-5
    data, held_out = Tokens(steps * PER_DEVICE * WORLD * ACCUM), Tokens(2 * WORLD, seed=3)
    runs = []
    for cls, kw in ((Trainer, {}), (ParoTrainer, {"strategy": "IIG"})):
        every_2 = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
        args = arguments(f"{out}/schedule_free", steps, optim="schedule_free_adamw", lr_scheduler_type="constant",
                         **every_2)  # fmt: skip
        trainer = cls(model=make_model(), args=args, train_dataset=data, eval_dataset=held_out, **kw)
        trainer.train()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        assert type(optimizer).__name__ == "AdamWScheduleFree", type(optimizer)
        model = trainer.model
        state = model.full_state_dict() if isinstance(model, paro_torch.ParoShardedModule) else model.state_dict()
        runs.append((trainer, {k: v.detach().clone() for k, v in state.items()}))
    (ref, want), (trainer, got) = runs
    assert trainer.model.strategy.code == "IIG" and not isinstance(ref.model, paro_torch.ParoShardedModule)
    losses, ref_losses = logged(trainer, "loss"), logged(ref, "loss")
    evals, ref_evals = logged(trainer, "eval_loss"), logged(ref, "eval_loss")
    assert sorted(losses) == sorted(ref_losses) == list(range(1, steps + 1)), (losses, ref_losses)
    assert sorted(evals) == sorted(ref_evals) == [2, 4], (evals, ref_evals)
    off = max(abs(a[s] - b[s]) for a, b in ((losses, ref_losses), (evals, ref_evals)) for s in a)
    assert off < tol, f"losses {losses}, eval losses {evals}; DDP's {ref_losses}, {ref_evals}"
    worst = close(got, want, tol, "schedule-free IIG vs the stock Trainer on DDP")
    rounded = [[round(v, 4) for v in d.values()] for d in (losses, evals)]
    report("schedule_free", f"losses {rounded[0]}, eval losses {rounded[1]} within {off:.2e} of DDP's, "
           f"max |param diff| {worst:.2e}")  # fmt: skip


CHECKS = {
    "full": check_full,
    "resume": check_resume,
    "lora": check_lora,
    "auto": check_auto,
    "defaults": check_defaults,
    "schedule_free": check_schedule_free,
}


def main() -> None:
    out, checks = sys.argv[1], sys.argv[2].split(",")
    hf_logging.set_verbosity_error()
    for name in checks:
        start = time.perf_counter()
        CHECKS[name](out)
        if RANK == 0:
            print(f"CHECK {name} took {time.perf_counter() - start:.1f}s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
