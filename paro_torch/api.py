"""User-facing configuration of ParoShardedModule: mixed precision as FSDP2's ``MixedPrecisionPolicy`` says it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Precision:
    """The dtypes the engine uses, resolved from a ``MixedPrecisionPolicy`` (masters are always float32)."""

    param: torch.dtype = torch.float32
    """Parameters for compute and their gathers."""
    reduce: torch.dtype = torch.float32
    """Gradient collectives: ``reduce_dtype``, else ``param_dtype``."""
    accumulate: torch.dtype = torch.float32
    """Gradients accumulated across micro-steps: float32, or ``reduce_dtype`` when the user sets it."""
    output: torch.dtype | None = None
    """The root's floating-point outputs are cast to it (``output_dtype``)."""
    cast_inputs: bool = False
    """Floating-point inputs of every unit are cast to ``param`` (``cast_forward_inputs``, low precision only)."""

    @staticmethod
    def of(policy: MixedPrecisionPolicy | None) -> Precision:
        """Resolves a policy; raises ValueError for dtypes the engine does not support."""
        if policy is None:
            return Precision()
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
        param = policy.param_dtype or torch.float32
        return Precision(
            param=param,
            reduce=policy.reduce_dtype or param,
            accumulate=policy.reduce_dtype or torch.float32,
            output=policy.output_dtype,
            cast_inputs=policy.cast_forward_inputs and param != torch.float32,
        )

    def bytes(self) -> dict[str, int]:
        """Bytes per element as the cost model's request names them (optimizer: Adam's m and v, plus masters)."""
        return {
            "param_bytes": self.param.itemsize,
            "grad_bytes": self.accumulate.itemsize,
            "reduce_bytes": self.reduce.itemsize,
            "optimizer_bytes": 8 if self.param == torch.float32 else 12,
        }


def divide_factors(world: int) -> tuple[float, float]:
    """(pre, post): gradients are divided by ``pre`` before a reduction and by ``post`` after (pre·post = n).

    As FSDP: ``pre`` is the largest power of two whose square is at most n, so that neither the summands nor the
    sums of n low-precision gradients leave the range.
    """
    pre = 1
    while (pre * 2) ** 2 <= world:
        pre *= 2
    return float(pre), world / pre
