"""User-facing configuration of ParoShardedModule: mixed precision as FSDP2's ``MixedPrecisionPolicy`` says it."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Precision:
    """The dtypes the engine uses: the model's own dtype, and a ``MixedPrecisionPolicy`` as FSDP2 applies it.

    [Note: mixed precision] As FSDP2's ``fully_shard``: without a policy the model keeps its dtype (a bfloat16 model
    is stored, gathered, computed, reduced and updated in bfloat16; each frozen buffer keeps its parameters'
    dtype). With ``param_dtype`` the sharded parameters (the optimizer's masters) keep the model's dtype and are
    cast to ``param_dtype`` for gathers and compute; gradients are reduced in ``reduce_dtype`` (default
    ``param_dtype``) and accumulated in the masters' dtype, as FSDP2 accumulates into the sharded ``.grad``.
    """

    master: torch.dtype = torch.float32
    """The trainable parameters' dtype (the model's): masters, ``.grad``, accumulation, optimizer states."""
    param: torch.dtype = torch.float32
    """Trainable parameters for compute and their gathers: ``param_dtype``, else ``master``."""
    reduce: torch.dtype = torch.float32
    """Gradient collectives: ``reduce_dtype``, else ``param``."""
    output: torch.dtype | None = None
    """The root's floating-point outputs are cast to it (``output_dtype``)."""
    cast_inputs: bool = False
    """Floating-point inputs of every unit are cast to ``param`` (``cast_forward_inputs`` with a ``param_dtype``)."""
    policy: MixedPrecisionPolicy | None = None
    """The policy these were resolved from."""

    @staticmethod
    def of(policy: MixedPrecisionPolicy | None, master: torch.dtype = torch.float32) -> Precision:
        """Resolves a policy over masters of dtype ``master``; raises for dtypes the engine does not support."""
        if not master.is_floating_point:
            raise ValueError(f"the model's trainable parameters must be floating-point, not {master}")
        if policy is None:
            return Precision(master=master, param=master, reduce=master)
        if not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError(
                f"mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy, not {type(policy).__name__}"
            )
        if getattr(policy, "param_dtype_override_fn", None) is not None:  # the field is new in torch 2.15
            raise ValueError("paro_torch does not support MixedPrecisionPolicy.param_dtype_override_fn")
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(policy, name)
            if dtype is not None and dtype not in _DTYPES:
                raise ValueError(f"MixedPrecisionPolicy.{name} must be bfloat16, float16 or float32, not {dtype}")
        param = policy.param_dtype or master
        return Precision(
            master=master,
            param=param,
            reduce=policy.reduce_dtype or param,
            output=policy.output_dtype,
            cast_inputs=policy.cast_forward_inputs and policy.param_dtype is not None,
            policy=policy,
        )

    def retyped(self, master: torch.dtype) -> Precision:
        """The same policy over masters of another dtype (``module.to(dtype)`` after wrapping)."""
        return Precision.of(self.policy, master)

    def frozen(self, own: torch.dtype) -> torch.dtype:
        """The storage and compute dtype of frozen parameters whose own dtype is ``own``."""
        return self.policy.param_dtype if self.policy is not None and self.policy.param_dtype else own

    def bytes(self) -> dict[str, int]:
        """Bytes per element as the cost model's request names them (optimizer: Adam's m and v, plus masters)."""
        separate = self.master.itemsize if self.param != self.master else 0  # masters apart from the parameters
        return {
            "param_bytes": self.param.itemsize,
            "grad_bytes": self.master.itemsize,
            "reduce_bytes": self.reduce.itemsize,
            "optimizer_bytes": 2 * self.master.itemsize + separate,
            "master_bytes": self.master.itemsize,
        }


def model_dtype(params: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype masters take for these parameters: the trainable ones' (promoted where they differ), else float32."""
    dtypes = {p.dtype for p in params if p.requires_grad and p.is_floating_point()}
    return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32


def divide_factors(world: int) -> tuple[float, float]:
    """(pre, post): gradients are divided by ``pre`` before a reduction and by ``post`` after (pre·post = n).

    As FSDP: ``pre`` is the largest power of two whose square is at most n, so that neither the summands nor the
    sums of n low-precision gradients leave the range.
    """
    pre = 1
    while (pre * 2) ** 2 <= world:
        pre *= 2
    return float(pre), world / pre
