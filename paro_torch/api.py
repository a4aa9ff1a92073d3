"""User-facing configuration of ParoShardedModule."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Low-precision compute and communication; masters and optimizer states stay float32 on the os shard."""

    param_dtype: torch.dtype = torch.bfloat16
    """dtype of parameters, gradients and their collectives (torch.bfloat16 or torch.float16)."""

    def __post_init__(self) -> None:
        if self.param_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"MixedPrecision.param_dtype must be bfloat16, float16 or float32, not {self.param_dtype}")
