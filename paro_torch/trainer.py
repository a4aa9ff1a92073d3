"""``ParoTrainer``: the Hugging Face ``Trainer`` with its model sharded by ``ParoShardedModule``.

Usage (launch with ``torchrun``; ``PARO_GROUP_SIZE`` or torchrun's ``LOCAL_WORLD_SIZE`` sets the group size)::

    from paro_torch.trainer import ParoTrainer

    trainer = ParoTrainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=ds, strategy="IIG")
    trainer.train()  # resume_from_checkpoint=... continues a ParoTrainer checkpoint
    trainer.save_model("out")  # on every rank: a full model that from_pretrained loads (PEFT: the adapter)

Everything else comes from ``TrainingArguments`` as usual: ``gradient_accumulation_steps`` (the boundary gradient sync
runs on the last micro-step only), ``max_grad_norm`` (``clip_grad_norm_`` over the sharded gradients: the global
norm), ``bf16`` (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``: bf16 compute and communication, masters and
gradient accumulation in the model's dtype; no autocast), ``optim`` (every torch optimizer; the default
``adamw_torch_fused`` included; schedule-free ones too, whose ``eval()``/``train()`` around an evaluation rewrite the
parameters in place: they sync again after the switch, docs/sharded-module.md), ``learning_rate``, ``weight_decay``
(the Trainer's own param groups), ``activation_checkpointing`` (alias ``gradient_checkpointing``; non-reentrant unless
``activation_checkpointing_kwargs`` say otherwise), ``lr_scheduler_type``, ``logging_steps``, ``eval_strategy``,
``save_steps`` and ``load_best_model_at_end`` (both need ``save_only_model=False``, the default, as resuming does).

[Note: ParoTrainer and the Trainer's plumbing]
- The model is wrapped when the trainer is built, so ``trainer.model`` is the ``ParoShardedModule`` (as the Trainer
  keeps the wrapped model in ``trainer.model`` under FSDP) and ``trainer.model.module`` is the Hugging Face model, whose
  parameters are now this rank's shards (DTensors, under their own names): call it through ``trainer.model`` only.
- accelerate must not wrap it again (``prepare`` would add DDP under torchrun, and autocast for bf16): the wrapper is
  marked ``_is_accelerate_prepared``, accelerate's own guard against double wrapping.
- Activation checkpointing: the Trainer calls ``self.model.activation_checkpointing_enable(...)`` (or the deprecated
  ``gradient_checkpointing_enable``), so the wrapper carries those methods of the Hugging Face model, bound to it. The
  model checkpoints its layers' ``forward`` inside their ``__call__``: the engine's unit hooks stay outside the
  recomputation, which runs after the unit's pre-backward gather.
- The optimizer is the Trainer's own (``create_optimizer`` on the Hugging Face model inside): its param groups (weight
  decay or not, by name) over the sharded parameters, as with FSDP2; gradient clipping is the Trainer's too.
- Checkpoints: ``checkpoint-N/`` holds what the Trainer writes (the full model as safetensors, ``scheduler.pt``,
  ``trainer_state.json``, one RNG file per rank) and ``checkpoint-N/paro/``, the sharded model and optimizer states
  (``paro_torch.checkpoint``), which also loads into another strategy or world size.

Tested with transformers 5.24.0, accelerate 1.16.0 and peft 0.21.2 (torch 2.15). Five private Trainer methods are
overridden, all for checkpoints: ``_save`` (gathers the full model for ``save_pretrained``),
``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler`` and
``_load_best_model`` (the sharded DCP checkpoint, which reshards on load, instead of one ``optimizer.pt``), hence the
pinned range of the ``hf`` extra.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME

from paro_torch.checkpoint import load_checkpoint, save_checkpoint
from paro_torch.sharded_module import ParoShardedModule, WrapPolicy

PARO_CHECKPOINT_DIR = "paro"
"""The subdirectory of a Trainer checkpoint (``checkpoint-N/``) with the sharded model and optimizer states."""

_FORWARDED_METHODS = (
    "activation_checkpointing_enable",
    "activation_checkpointing_disable",
    "gradient_checkpointing_enable",  # the deprecated names, which the Trainer falls back to
    "gradient_checkpointing_disable",
)
"""Methods of the Hugging Face model that the wrapper exposes as its own (bound to the model inside)."""


def tokens_per_micro_step(dataset: Any, per_device_batch: int) -> int | None:
    """Tokens one rank processes per micro-step, for ``auto``'s predicted step time.

    The batch size times the length of the dataset's first ``input_ids``; None when the dataset cannot say (e.g. an
    iterable one).
    """
    try:
        return per_device_batch * len(dataset[0]["input_ids"])
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return None


class ParoTrainer(Trainer):
    """A ``transformers.Trainer`` that trains its model with PaRO-DP (``ParoShardedModule``).

    Takes every argument of ``Trainer`` plus the keyword arguments below; ``optimizers=`` is not accepted (the
    optimizer must be built over the sharded parameters: pass ``optimizer_cls_and_kwargs=`` or ``args.optim``). Building
    it is collective (every rank). Afterwards ``trainer.model`` is the ``ParoShardedModule`` (``.strategy``, ``.plan``)
    and ``trainer.model.module`` the Hugging Face model given, which runs only through ``trainer.model``.

    Args:
        strategy: A code ("IIG"), an alias ("zero3", "hsdp", ...) or "auto" (the cost model's fastest strategy that
            fits ``memory_budget``, given ``args.gradient_accumulation_steps``).
        group_size: Ranks per group; default PARO_GROUP_SIZE, else torchrun's LOCAL_WORLD_SIZE.
        wrap_policy: Module classes (or a predicate) that become units; default the classes named in the model's
            ``_no_split_modules`` (its decoder layers).
        memory_budget: Bytes per rank for model states (for ``auto``, and a check otherwise).
        calibration: Link figures for ``auto`` (a ``LinkCalibration`` or a JSON path).
        tokens_per_micro_step: Tokens one rank processes per micro-step, so that ``auto`` predicts compute too;
            default ``per_device_train_batch_size`` times the length of the training set's first ``input_ids``.
            With it, ``auto`` also times the model itself on the training set's first micro-batch
            (``ParoShardedModule``'s ``example_inputs``).

    Raises:
        RuntimeError: torch.distributed is not initialized (launch with torchrun).
        ValueError: a model already wrapped, ``optimizers=`` given, or ``fp16`` set.
    """

    def __init__(
        self,
        *trainer_args: Any,
        strategy: str = "auto",
        group_size: int | None = None,
        wrap_policy: WrapPolicy = None,
        memory_budget: int | None = None,
        calibration: Any = None,
        tokens_per_micro_step: int | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        self.paro_options = {
            "strategy": strategy,
            "group_size": group_size,
            "wrap_policy": wrap_policy,
            "memory_budget": memory_budget,
            "calibration": calibration,
            "tokens_per_micro_step": tokens_per_micro_step,
        }
        model = trainer_kwargs.get("model", trainer_args[0] if trainer_args else None)
        if isinstance(model, ParoShardedModule):
            raise ValueError("pass ParoTrainer the Hugging Face model itself: it wraps it in a ParoShardedModule")
        super().__init__(*trainer_args, **trainer_kwargs)
        self._wrap_paro()

    # ------------------------------------------------------------------------------------------------ wrapping
    def _wrap_paro(self) -> ParoShardedModule:
        """Wraps ``self.model`` (once; again after ``model_init`` made a new one); collective."""
        if isinstance(self.model, ParoShardedModule):
            return self.model
        if not dist.is_initialized():
            raise RuntimeError("ParoTrainer needs torch.distributed: launch the script with torchrun")
        if self.optimizer is not None:
            raise ValueError(
                "ParoTrainer builds the optimizer over the sharded parameters: pass optimizer_cls_and_kwargs="
                "(cls, kwargs) (or args.optim) instead of optimizers="
            )
        if self.args.fp16:
            raise ValueError("ParoTrainer supports bf16 mixed precision (args.bf16=True), not fp16")
        model = self.model
        self._set_signature_columns_if_needed()  # read off the Hugging Face model's forward before wrapping
        opts = dict(self.paro_options)
        if opts["wrap_policy"] is None:
            opts["wrap_policy"] = _no_split_classes(model)
        opts["activation_checkpointing"] = bool(self.args.gradient_checkpointing)  # the Trainer turns it on later
        opts["clips_grad_norm"] = bool(self.args.max_grad_norm)  # the Trainer clips when it is set and not 0
        if opts["tokens_per_micro_step"] is None:
            batch = self.args.per_device_train_batch_size
            opts["tokens_per_micro_step"] = tokens_per_micro_step(self.train_dataset, batch)
        if opts["strategy"].strip().lower() == "auto" and opts["tokens_per_micro_step"] is not None:
            opts["example_inputs"] = self._example_batch()  # auto times the model itself on it
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if self.args.bf16 else None
        opts.setdefault("device", self.args.device)  # where the Trainer puts the model and its batches
        paro = ParoShardedModule(
            model, opts.pop("strategy"), mixed_precision=mp, grad_accum=self.args.gradient_accumulation_steps, **opts
        )
        paro._is_accelerate_prepared = True  # accelerate's guard: no DDP, no autocast around it
        # the Trainer turns activation checkpointing on through self.model: the calls go to the model inside
        for name in _FORWARDED_METHODS:
            method = getattr(model, name, None)
            if callable(method):
                setattr(paro, name, method)
        self.model = self.model_wrapped = self.callback_handler.model = paro
        return paro

    def _example_batch(self) -> dict[str, Any] | None:
        """One micro-batch as the Trainer feeds the model: the training set's first items, its columns, collated.

        None when the dataset cannot be indexed (e.g. an iterable one), or the model is not on the Trainer's
        device, where the engine runs and the probe times it.
        """
        if any(p.device.type != torch.device(self.args.device).type for p in self.model.parameters()):
            return None
        columns = set(self._signature_columns or ())
        try:
            items = [self.train_dataset[i] for i in range(self.args.per_device_train_batch_size)]
            items = [{k: v for k, v in item.items() if not columns or k in columns} for item in items]
        except (TypeError, KeyError, IndexError, AttributeError, NotImplementedError):
            return None
        batch = dict(self.data_collator(items))
        return {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, built on the Hugging Face model inside: its sharded parameters, by name."""
        paro = self._wrap_paro()
        return super().create_optimizer(paro.module if model is None or model is paro else model)

    def training_step(self, model: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One micro-step; the boundary gradient sync runs only when the Trainer steps the optimizer after it."""
        if isinstance(model, ParoShardedModule):
            model.set_requires_gradient_sync(self.accelerator.sync_gradients)
        return super().training_step(model, *args, **kwargs)

    # ---------------------------------------------------------------------------------------- saving, resuming
    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """Gathers the full state dict (on every rank), then the Trainer saves the inner model with it."""
        if not isinstance(self.model, ParoShardedModule):
            return super()._save(output_dir, state_dict)
        paro = self.model
        # collective; save_pretrained reads the parameters (their dtype), not only the state dict
        with paro.summon_full_params(rank0_only=not self.args.save_on_each_node):
            if not self.args.should_save:
                return
            if state_dict is None:
                state_dict = paro.module.state_dict()  # the gathered parameters and the persistent buffers
            self.model = paro.module  # the Hugging Face (or PEFT) model, which save_pretrained knows
            try:
                super()._save(output_dir, state_dict)
            finally:
                self.model = paro

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not isinstance(self.model, ParoShardedModule):
            return super()._save_optimizer_and_scheduler(output_dir)
        save_checkpoint(os.path.join(output_dir, PARO_CHECKPOINT_DIR), self.model, _inner(self.optimizer))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Only checks: the parameters load with the optimizer states, once the optimizer exists."""
        if not isinstance(model if model is not None else self.model, ParoShardedModule):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._sharded_checkpoint(resume_from_checkpoint, "resume from")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not isinstance(self.model, ParoShardedModule):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_checkpoint(self._sharded_checkpoint(checkpoint, "resume from"), self.model, _inner(self.optimizer))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        if not isinstance(self.model, ParoShardedModule):
            return super()._load_best_model()
        load_checkpoint(
            self._sharded_checkpoint(self.state.best_model_checkpoint, "load the best model from"), self.model
        )

    def _sharded_checkpoint(self, checkpoint: str, action: str) -> str:
        path = os.path.join(checkpoint, PARO_CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise ValueError(
                f"{checkpoint} has no {PARO_CHECKPOINT_DIR}/ directory: ParoTrainer can {action} the checkpoints it "
                "saves with save_only_model=False only; to start from saved weights, load them into the model before "
                "building the trainer"
            )
        return path


def _no_split_classes(model: nn.Module) -> set[type[nn.Module]] | None:
    """The module classes named in ``_no_split_modules`` of the Hugging Face models inside ``model``."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    return classes or None


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)
