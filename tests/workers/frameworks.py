"""DDP, FSDP1 and FSDP2 running on the ``paro`` backend train to the parameters of single-process training."""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import paro_torch  # noqa: F401  (registers "paro")

STEPS = 3
BATCH = 4  # per rank


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def wrap(framework: str, model: nn.Module, world: int, group_size: int) -> tuple[nn.Module, list]:
    """Wraps the model; also returns the process groups its collectives run on."""
    from torch.distributed.device_mesh import init_device_mesh

    if framework == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), [None]
    if framework.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

        if framework == "fsdp1_full":
            wrapped = FullyShardedDataParallel(
                model, sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu")
            )
            return wrapped, [None]
        mesh = init_device_mesh("cpu", (world // group_size, group_size), mesh_dim_names=("replicate", "shard"))
        wrapped = FullyShardedDataParallel(
            model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh, device_id=torch.device("cpu")
        )
        return wrapped, [mesh.get_group(0), mesh.get_group(1)]
    from torch.distributed.fsdp import fully_shard

    if framework == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
    else:  # hsdp
        mesh = init_device_mesh("cpu", (world // group_size, group_size), mesh_dim_names=("dp_replicate", "dp_shard"))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    return fully_shard(model, mesh=mesh), groups


def full_params(framework: str, model: nn.Module) -> list[torch.Tensor]:
    if framework.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    out = []
    for p in model.parameters():
        out.append(p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone())
    return out


def train_reference(world: int) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """The global batch and the model trained on it by one process with SGD."""
    torch.manual_seed(1)
    x = torch.randn(world * BATCH, 12)
    y = torch.randn(world * BATCH, 3)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(STEPS):
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    return x, y, ref


def check(framework: str, x: torch.Tensor, y: torch.Tensor, ref: nn.Module) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    group_size = paro_torch._backend.resolve_group_size(world)
    model, groups = wrap(framework, copy.deepcopy(make_model()), world, group_size)
    for pg in groups:  # what this framework's training sends (the world group served the ones before it too)
        paro_torch.reset_comm_stats(pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    got = full_params(framework, model)
    worst = max((a - b).abs().max().item() for a, b in zip(got, ref.parameters(), strict=True))
    assert worst < 1e-6, f"{framework}: parameters differ from single-process training by {worst}"
    stats = [paro_torch.comm_stats(pg) for pg in groups]
    assert all(s.intra_ops + s.inter_ops + s.flat_ops > 0 for s in stats), (
        f"{framework}: a group carried nothing: {stats}"
    )
    print(f"rank {rank}: {framework} max |diff| {worst:.2e}; {stats}", flush=True)


def main() -> None:
    dist.init_process_group("paro")
    x, y, ref = train_reference(dist.get_world_size())
    for framework in sys.argv[1].split(","):  # one after another in this process
        check(framework, x, y, ref)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
