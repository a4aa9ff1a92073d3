"""Train a small decoder-only transformer with PaRO-DP (ParoShardedModule) on CPU ranks.

    PARO_GROUP_SIZE=2 torchrun --standalone --nproc-per-node 4 examples/train.py --strategy IIG

4 ranks as 2 groups of 2: parameters and gradients are sharded inside each group, optimizer states across
all ranks (IIG). Each step prints the loss, the step time and the bytes this rank sent inside its group
(intra) and between groups (inter), as counted by the `paro` backend.
"""

import argparse
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import paro_torch
from paro_torch import ParoShardedModule


class Block(nn.Module):
    """Pre-norm attention + MLP block (causal)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def corpus() -> torch.Tensor:
    """Bytes of the repository's own documentation: a small corpus that ships with it."""
    root = Path(__file__).resolve().parent.parent
    text = b"\n".join(p.read_bytes() for p in sorted(root.glob("*.md")) + sorted(root.glob("benchmarks/*.md")))
    return torch.tensor(list(text), dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategy", default="IIG", help="a PaRO code (IIG, NII, ...), an alias (zero3, hsdp, ddp) or auto"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ParoShardedModule(
        TinyLM(256, args.dim, args.layers, 4, args.seq),
        args.strategy,
        wrap_policy={Block},
        grad_accum=args.grad_accum,  # for strategy="auto": the cost model weighs per-micro-step traffic by it
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    levels = [pg for pg in (model.groups.intra, model.groups.inter) if pg is not None]
    data = corpus()
    gen = torch.Generator().manual_seed(rank)
    if rank == 0:
        g = model.groups
        print(f"{model.strategy.code} on {world} ranks = {g.num_groups} groups x {g.group_size}; "
              f"{sum(p.numel() for p in model.parameters())} parameters in this rank's optimizer shard")  # fmt: skip
    for step in range(args.steps):
        for pg in levels:
            paro_torch.reset_comm_stats(pg)
        start = time.perf_counter()
        total = torch.zeros(())
        for micro in range(args.grad_accum):
            starts = torch.randint(0, data.numel() - args.seq - 1, (args.micro_batch,), generator=gen)
            batch = torch.stack([data[s : s + args.seq + 1] for s in starts])
            ctx = model.no_sync() if micro < args.grad_accum - 1 else torch.enable_grad()
            with ctx:
                logits = model(batch[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
                (loss / args.grad_accum).backward()
            total += loss.detach() / args.grad_accum
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        intra = paro_torch.comm_stats(model.groups.intra).intra_bytes if model.groups.intra is not None else 0
        inter = paro_torch.comm_stats(model.groups.inter).inter_bytes if model.groups.inter is not None else 0
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step:3d}  loss {total.item() / world:.4f}  {elapsed:.2f}s  "
                  f"intra {intra / 1e6:.2f} MB  inter {inter / 1e6:.3f} MB", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
