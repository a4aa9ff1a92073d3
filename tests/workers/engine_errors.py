"""Bad ParoShardedModule input raises a clear error on every rank, and nothing hangs."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import paro_torch
from paro_torch import ParoShardedModule


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def main() -> None:
    case = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    kwargs: dict = {"group_size": 2}
    strategy = "IIG"
    if case == "unknown":
        strategy = "IIX"
    elif case == "eliminated":
        strategy = "INN"
    elif case == "group_size":
        kwargs["group_size"] = 3
    elif case == "disagree_strategy":
        strategy = "IIG" if rank else "GGG"
    elif case == "disagree_group_size":
        kwargs["group_size"] = 2 if rank else 4
    elif case == "disagree_model":
        if rank == 1:
            model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))
    elif case == "tied_across_units":
        model[1].weight = model[0].weight  # in two units: each Linear is one
        kwargs["wrap_policy"] = {nn.Linear}
    elif case == "meta_uninitialised":  # a norm without reset_parameters() on the meta device, no param_init_fn
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), RMSNorm(4), nn.Linear(4, 2))
    elif case == "wrapped_twice":
        ParoShardedModule(model, strategy, **kwargs)
    elif case == "int_param":
        if rank == 0:  # only one rank is wrong: the others must still fail, not wait
            model.register_parameter("step", nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False))
    try:
        ParoShardedModule(model, strategy, **kwargs)
        print(f"rank {rank}: accepted", flush=True)
        code = 1
    except ValueError as e:
        print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
        code = 0
    dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    assert paro_torch.STRATEGIES
    main()
