"""``ParoStrategy``: PaRO-DP as a PyTorch Lightning strategy, ``L.Trainer(strategy="paro")``.

Usage (``pip install "paro-torch[lightning]"``; importing this module registers the strategy names)::

    import lightning as L
    import paro_torch.lightning  # registers "paro" (auto) and "paro_<code>" ("paro_IIG", "paro_zero3", ...)

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="paro")  # or ParoStrategy("IIG", group_size=2)
    trainer.fit(module)  # the LightningModule is unchanged

The strategy is Lightning's DDP strategy with the model wrapped in a ``ParoShardedModule`` instead of
``DistributedDataParallel``: process groups, launching, ``barrier``/``broadcast``/``reduce`` and the training loop are
Lightning's. ``configure_optimizers`` runs after wrapping, so the optimizer gets this rank's shards (DTensors under the
module's own names: param groups work as written); gradient clipping (``gradient_clip_val``) is torch's
``clip_grad_norm_``, the global norm over the shards; accumulation steps (``accumulate_grad_batches``) skip the gradient
sync (``no_sync``). Precision: ``"bf16-mixed"`` autocasts over float32 parameters as usual; ``"bf16-true"`` becomes
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (bf16 compute and communication, float32 masters), unless
``mixed_precision=`` is given; ``"16-mixed"`` autocasts to float16 with loss scaling by a ``ShardedGradScaler`` over the
world (as Lightning's FSDP strategy), which skips a step on every rank when any rank's gradient shard overflows. A
module built under ``trainer.init_module(empty_init=True)`` lives on the meta device and is initialised unit by unit
while it is sharded.

Checkpoints (``trainer.save_checkpoint``, ``ModelCheckpoint``, ``fit(ckpt_path=...)``) are the project's sharded DCP
checkpoints (``paro_torch.checkpoint``): a directory with the model, its buffers and the optimizer's state, which loads
into another strategy, group size or world size, plus Lightning's own state (loops, schedulers, callbacks) written by
rank 0 inside the same atomic save. ``strategy.save_consolidated(path)`` writes the whole model as one safetensors file
for inference. Tested with lightning 2.6.6 (the ``lightning`` extra pins it).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Generator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from paro_torch import _C
from paro_torch import checkpoint as sharded
from paro_torch.sharded_module import ParoShardedModule, WrapPolicy


class ParoStrategy(DDPStrategy):
    """Lightning's DDP strategy with PaRO-DP (``ParoShardedModule``) in place of ``DistributedDataParallel``.

    Args:
        strategy: A code ("IIG"), an alias ("zero3", "hsdp") or "auto" (the cost model's fastest strategy that fits,
            given ``accumulate_grad_batches``).
        group_size: Ranks per group; default PARO_GROUP_SIZE, else the ranks per node.
        wrap_policy: Module classes (or a predicate) whose instances become communication units.
        mixed_precision: A ``MixedPrecisionPolicy``; default from the Trainer's precision (see the module notes).
        memory_budget: Bytes per rank for model states (``auto``, and a check otherwise).
        calibration: Link figures for ``auto`` (a ``LinkCalibration`` or a JSON path).
        tokens_per_micro_step: Tokens (batch x sequence) one rank processes per training step of the LightningModule,
            so that ``auto`` predicts the compute that hides communication too (Lightning wraps the model before the
            data is set up, so it cannot be read off the dataloader).
        activation_checkpointing: Whether the model recomputes activations in backward, for ``auto``; default: the
            model says so (Hugging Face's ``is_gradient_checkpointing``, or ``checkpoint_wrapper``).
        example_inputs: One micro-batch as the LightningModule's ``forward`` takes it (a dict of keyword arguments,
            a tuple of positional ones or a tensor, on the strategy's device), with ``tokens_per_micro_step``: the
            cost model's compute and optimizer throughputs are then timed on the model itself before sharding
            (``ParoShardedModule(example_inputs=)``), rather than on stand-in layers. ``forward`` must return a
            ``loss`` or a float tensor that needs a gradient.
        **kwargs: Lightning's DDP strategy arguments (``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``, ``start_method``).

    Raises:
        InvalidStrategyError: an unknown or eliminated strategy code, on every rank, when the strategy is built.
    """

    strategy_name = "paro"

    def __init__(
        self,
        strategy: str = "auto",
        *,
        group_size: int | None = None,
        wrap_policy: WrapPolicy = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        memory_budget: int | None = None,
        calibration: Any = None,
        tokens_per_micro_step: int | None = None,
        activation_checkpointing: bool | None = None,
        example_inputs: Any = None,
        **kwargs: Any,
    ) -> None:
        if strategy.strip().lower() != "auto":
            _C.Strategy(strategy)  # an unknown code fails here, on every rank, before any process group exists
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be a positive number of ranks, not {group_size}")
        super().__init__(**kwargs)
        self.paro_strategy = strategy
        self._paro_options: dict[str, Any] = {
            "group_size": group_size,
            "wrap_policy": wrap_policy,
            "memory_budget": memory_budget,
            "calibration": calibration,
            "tokens_per_micro_step": tokens_per_micro_step,
            "activation_checkpointing": activation_checkpointing,
            "example_inputs": example_inputs,
        }
        self._mixed_precision = mixed_precision
        self._wrapped: ParoShardedModule | None = None
        """The sharded LightningModule, once a fit wrapped it: validate/test/predict and another fit reuse it."""

    # ----------------------------------------------------------------------------------------------- precision
    @property
    def precision_plugin(self) -> Precision:
        """The precision plugin Lightning chose (``Precision()`` until it has), its loss scaler sharded."""
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning's plugin; a loss scaler (``"16-mixed"``) becomes a ``ShardedGradScaler`` with its settings.

        A plain ``GradScaler`` checks this rank's gradient shards for inf/NaN, and torch's DTensor shares what it
        found only over the mesh dimensions a gradient is sharded on (one group where the optimizer states are
        sharded within groups): some ranks would skip the step and lower their scale while others step. The sharded
        one all-reduces it over the default process group, which Lightning sets up as the world.
        """
        scaler = getattr(plugin, "scaler", None)
        if isinstance(plugin, MixedPrecision) and scaler is not None and not isinstance(scaler, ShardedGradScaler):
            plugin.scaler = _sharded_scaler(scaler)
        self._precision_plugin = plugin

    # ------------------------------------------------------------------------------------------------ wrapping
    def setup(self, trainer: L.Trainer) -> None:
        """As DDP's; evaluating a module that a fit sharded runs on its shards (no wrapping, no broadcast of them)."""
        if trainer.state.fn == TrainerFn.FITTING or not self._sharded(self.model):
            super().setup(trainer)
            return
        assert self.accelerator is not None and self._wrapped is not None
        self.accelerator.setup(trainer)
        self.model = self._wrapped
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        """As DDP's, but a module built on the meta device is materialised while it is wrapped (on the device)."""
        assert self.model is not None
        if self._sharded(self.model):
            assert self._wrapped is not None
            self._wrapped.to(self.root_device)  # keeps the engine's storage (ParoShardedModule._apply)
        elif not any(p.is_meta for p in self.model.parameters()):
            super().model_to_device()

    def teardown(self) -> None:
        """As DDP's, except that a sharded module and its optimizer's states stay on their device.

        Lightning moves the LightningModule to the CPU at teardown; its parameters are the engine's shards, whose
        storage is set at wrapping (``ParoShardedModule(device=)``): a later validate, test, predict or fit on the
        same module runs on them where they are.
        """
        module = self.lightning_module
        if self._wrapped is None or module is None:
            super().teardown()
            return
        optimizers, self.optimizers = self.optimizers, []
        module.__dict__["cpu"] = lambda: module  # Strategy.teardown's move, for this call only
        try:
            super().teardown()
        finally:
            del module.__dict__["cpu"]
            self.optimizers = optimizers

    def _sharded(self, model: nn.Module | None) -> bool:
        """Whether ``model`` was wrapped before (by this strategy or another's fit); keeps that wrapper."""
        wrapper = ParoShardedModule.of(model) if model is not None else None
        if wrapper is not None:
            self._wrapped = wrapper
        return wrapper is not None

    def _setup_model(self, model: nn.Module) -> ParoShardedModule:  # type: ignore[override]
        """Wraps the LightningModule (collective); Lightning builds the optimizers afterwards."""
        if self._sharded(model):  # a second fit of the same module
            assert self._wrapped is not None
            code = self._wrapped.strategy.code
            if self.paro_strategy.strip().lower() != "auto" and _C.Strategy(self.paro_strategy).code != code:
                raise ValueError(
                    f"this LightningModule was sharded as {code} by an earlier fit; fit it with strategy "
                    f"'paro_{code}' (or 'paro'), or load its checkpoint into a fresh module to change strategy"
                )
            return self._wrapped
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        accum = trainer.accumulate_grad_batches if trainer is not None else 1
        # Lightning clips by norm when gradient_clip_val is set, unless gradient_clip_algorithm is "value"
        clips = trainer is not None and bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm != "value"
        self._wrapped = ParoShardedModule(
            model,
            self.paro_strategy,
            mixed_precision=self._policy(),
            grad_accum=accum,
            clips_grad_norm=clips,
            device=self.root_device,
            **self._paro_options,
        )
        return self._wrapped

    def _policy(self) -> MixedPrecisionPolicy | None:
        if self._mixed_precision is not None:
            return self._mixed_precision
        plugin = self.precision_plugin
        if isinstance(plugin, HalfPrecision) and plugin._desired_input_dtype != torch.float32:
            return MixedPrecisionPolicy(param_dtype=plugin._desired_input_dtype)
        return None

    def _register_ddp_hooks(self) -> None:
        """DDP communication hooks do not apply: the engine runs its own collectives."""

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-steps: no gradient sync until the step's last backward (``no_sync``)."""
        if isinstance(self.model, ParoShardedModule):
            with self.model.no_sync():
                yield
        else:
            yield

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init=True``: the module is built on the meta device and initialised unit by unit when wrapped."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    # -------------------------------------------------------------------------------------------- checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the wrapped model and the optimizer built over its shards."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The optimizer's state loads with the model (``load_checkpoint``), resharded."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the model goes into the sharded checkpoint in ``save_checkpoint``."""
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Empty: the optimizer's state goes into the sharded checkpoint in ``save_checkpoint``."""
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Writes a sharded checkpoint directory at ``filepath``; collective (Lightning calls it on every rank)."""
        if storage_options is not None:
            raise TypeError("ParoStrategy.save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(str(filepath)))
        checkpoint = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        sharded.save_checkpoint(path, self._paro_model(), self._optimizer(), extra=checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads model and optimizer state from a ``save_checkpoint`` directory; returns Lightning's state."""
        path = Path(self.broadcast(str(checkpoint_path)))
        fitting = self.lightning_module is not None and self.lightning_module.trainer.training
        sharded.load_checkpoint(path, self._paro_model(), self._optimizer() if fitting else None)
        return sharded.read_extra(path)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing: ``load_checkpoint`` loaded the model."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing: ``load_checkpoint`` loaded the optimizer's state."""

    def remove_checkpoint(self, filepath: Any) -> None:
        """Deletes a checkpoint directory (rank 0)."""
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def save_consolidated(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Writes the whole model (the masters, or ``dtype``) as one safetensors file on rank 0; collective."""
        sharded.export_safetensors(self._paro_model(), path, dtype)

    def _paro_model(self) -> ParoShardedModule:
        if not isinstance(self.model, ParoShardedModule):
            raise RuntimeError("ParoStrategy: the model is not wrapped yet (checkpoints need trainer.fit's setup)")
        return self.model

    def _optimizer(self) -> torch.optim.Optimizer | None:
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        if len(optimizers) > 1:
            raise ValueError(
                f"ParoStrategy checkpoints hold one optimizer; configure_optimizers returned {len(optimizers)}"
            )
        return optimizers[0] if optimizers else None


def _sharded_scaler(scaler: torch.amp.GradScaler) -> ShardedGradScaler:
    """A ``ShardedGradScaler`` over the default process group with ``scaler``'s device, settings and state."""
    sharded = ShardedGradScaler(device=scaler._device, enabled=scaler.is_enabled(), process_group=None)
    if scaler.is_enabled():
        sharded.load_state_dict(scaler.state_dict())
    return sharded


def _register() -> None:
    """Registers "paro" (auto) and "paro_<code>" for every strategy code and alias, once."""
    # Lightning lowercases the name it is given ("paro_IIG" -> "paro_iig")
    codes = [*_C.STRATEGIES, *(alias for alias, _ in _C.ALIASES)]
    names = {"paro": "auto"} | {f"paro_{c.lower()}": c for c in codes}
    for name, code in names.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, ParoStrategy, description=f"PaRO-DP, strategy {code}")
            # set apart: register()'s own second parameter is named "strategy" too
            StrategyRegistry[name]["init_params"] = {"strategy": code}


_register()
