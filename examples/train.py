"""Train a small LLaMA with PaRO-DP (ParoShardedModule) on CPU ranks, the strategy chosen by the cost model.

    PARO_GROUP_SIZE=2 torchrun --standalone --nproc-per-node 4 examples/train.py --strategy auto

4 ranks as 2 groups of 2 (on a cluster: PARO_GROUP_SIZE defaults to torchrun's ranks per node). The model
is a LlamaForCausalLM from a small config (random weights, nothing downloaded) trained on the bytes of this
repository's documentation. Each step prints the loss, the step time and the bytes this rank sent inside its
group (intra) and between groups (inter) as the engine counts them (``model.comm_bytes()``: each collective by the
ring formula, as the cost model counts it; not measured on the wire). ``--checkpoint DIR`` saves a
sharded checkpoint at the end (and every ``--save-every`` steps) and resumes from it when it exists, at any world
size and strategy. Batches depend only on the step and the rank, so a resumed run trains exactly as an
uninterrupted one; under ``torchrun --max-restarts 1`` a job whose rank died resumes by itself (with torch 2.15, set
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun: otherwise a restarted attempt reads the dead one's addresses).
"""

import argparse
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from paro_torch import ParoShardedModule
from paro_torch.checkpoint import load_checkpoint, read_extra, save_checkpoint


def corpus() -> torch.Tensor:
    """Bytes of the repository's own documentation: a small corpus that ships with it."""
    root = Path(__file__).resolve().parent.parent
    text = b"\n".join(p.read_bytes() for p in sorted(root.glob("*.md")) + sorted(root.glob("benchmarks/*.md")))
    return torch.tensor(list(text), dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto", help="auto, a PaRO code (IIG, NII, ...) or an alias (zero3)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--checkpoint", type=Path, help="a directory: resume from it if it exists, save at the end")
    parser.add_argument("--save-every", type=int, default=0, help="also save the checkpoint every N steps")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,  # bytes
        hidden_size=args.dim,
        intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,  # ParoShardedModule shards each parameter once
    )
    model = ParoShardedModule(
        LlamaForCausalLM(config),
        args.strategy,
        wrap_policy={LlamaDecoderLayer},  # one unit (flat buffer, gather, reduce) per decoder layer
        grad_accum=args.grad_accum,  # for strategy="auto": the cost model weighs per-micro-step traffic by it
        tokens_per_micro_step=args.micro_batch * args.seq,  # and the compute that hides communication by this
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = 0
    if args.checkpoint is not None and args.checkpoint.exists():
        load_checkpoint(args.checkpoint, model, opt)
        first = read_extra(args.checkpoint).get("step", -1) + 1
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {first}")
    data = corpus()
    if rank == 0:
        g = model.groups
        print(f"{model.strategy.code} on {world} ranks = {g.num_groups} groups x {g.group_size}; "
              f"{sum(p.numel() for p in model.parameters())} parameters in this rank's optimizer shard")  # fmt: skip
    bar = tqdm(range(first, args.steps), desc="train", disable=rank != 0, dynamic_ncols=True)
    for step in bar:
        gen = torch.Generator().manual_seed(step * world + rank)  # this step's batches, also after a resume
        model.reset_comm_bytes()
        start = time.perf_counter()
        total = torch.zeros(())
        for micro in range(args.grad_accum):
            starts = torch.randint(0, data.numel() - args.seq, (args.micro_batch,), generator=gen)
            batch = torch.stack([data[s : s + args.seq] for s in starts])
            sync = micro == args.grad_accum - 1  # reduce gradients across groups on the last micro-step only
            model.set_requires_gradient_sync(sync)
            loss = model(input_ids=batch, labels=batch).loss  # the model shifts the labels
            (loss / args.grad_accum).backward()
            total += loss.detach() / args.grad_accum
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        sent = model.comm_bytes()  # nominal: each collective by the ring formula, as the cost model counts
        intra, inter = sent["intra"], sent["inter"]
        dist.all_reduce(total)
        bar.set_postfix(loss=f"{total.item() / world:.3f}")
        if rank == 0:
            bar.write(f"step {step:3d}  loss {total.item() / world:.4f}  {elapsed:.2f}s  "
                      f"intra {intra / 1e6:.2f} MB  inter {inter / 1e6:.3f} MB")  # fmt: skip
        last = step == args.steps - 1
        if args.checkpoint is not None and (last or (args.save_every and (step + 1) % args.save_every == 0)):
            save_checkpoint(args.checkpoint, model, opt, extra={"step": step})
            if rank == 0:
                bar.write(f"saved {args.checkpoint} after step {step}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
