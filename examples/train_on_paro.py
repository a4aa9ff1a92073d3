"""Train a small transformer with FSDP2 (HSDP: shard inside a group, replicate across) over the `paro` backend.

    PARO_GROUP_SIZE=2 torchrun --standalone --nproc-per-node 4 examples/train_on_paro.py

Every collective FSDP issues runs hierarchically: intra-group steps on the fast links, inter-group steps
on one rail per rank. Each step prints the loss and the bytes this rank sent at each level.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import paro_torch


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    dist.init_process_group("paro")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = paro_torch._backend.resolve_group_size(world)
    mesh = init_device_mesh("cpu", (world // m, m), mesh_dim_names=("dp_replicate", "dp_shard"))

    torch.manual_seed(0)
    vocab = 256
    model = nn.Sequential(nn.Embedding(vocab, args.dim), *[Block(args.dim) for _ in range(args.layers)],
                          nn.Linear(args.dim, vocab))  # fmt: skip
    for layer in model[1:-1]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    groups = [mesh.get_group(0), mesh.get_group(1)]

    text = torch.tensor(list((open(__file__, "rb").read() * 4)[:4096]), dtype=torch.long)
    for step in range(args.steps):
        for pg in groups:
            paro_torch.reset_comm_stats(pg)
        start = time.perf_counter()
        g = torch.Generator().manual_seed(step * world + rank)
        idx = torch.randint(0, text.numel() - 33, (8,), generator=g)
        batch = torch.stack([text[i : i + 33] for i in idx])
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = [paro_torch.comm_stats(pg) for pg in groups]
        intra = sum(s.intra_bytes for s in stats)
        inter = sum(s.inter_bytes for s in stats)
        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step}: loss {loss_avg.item():.4f}  {time.perf_counter() - start:.2f}s  "
                  f"intra {intra / 1e6:.2f} MB  inter {inter / 1e6:.2f} MB")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
