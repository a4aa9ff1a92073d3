"""Train a small LLaMA with PyTorch Lightning and PaRO-DP: ``L.Trainer(strategy="paro")``, the LightningModule as is.

    PARO_GROUP_SIZE=2 torchrun --standalone --nproc-per-node 4 examples/train_lightning.py --strategy paro

``--strategy`` takes "paro" (the cost model's choice), "paro_<code>" ("paro_IIG", "paro_zero3") or "ddp" to compare.
The model is a LlamaForCausalLM from a small config (random weights, nothing downloaded) trained on the bytes of this
repository's documentation; ``--precision bf16-true`` computes in bf16 over float32 masters. ``--checkpoint DIR``
saves a sharded checkpoint at the end and resumes from it when it exists (at any world size and strategy).
"""

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import paro_torch.lightning  # noqa: F401  (registers "paro" and "paro_<code>" with Lightning)
from paro_torch.lightning import ParoStrategy


class Windows(Dataset):
    """Windows of the repository's documentation bytes: a small corpus that ships with it."""

    def __init__(self, seq: int) -> None:
        root = Path(__file__).resolve().parent.parent
        text = b"\n".join(p.read_bytes() for p in sorted(root.glob("*.md")) + sorted(root.glob("benchmarks/*.md")))
        self.tokens, self.seq = torch.tensor(list(text), dtype=torch.long), seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.seq : (i + 1) * self.seq + 1]


class LanguageModel(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
        self.llama, self.lr = LlamaForCausalLM(config), lr

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.llama(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]  # the model's own names and shapes
        rest = [p for n, p in self.named_parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 100)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="paro", help='"paro", "paro_<code>" ("paro_IIG") or "ddp"')
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed or bf16-true")
    parser.add_argument("--checkpoint", type=Path, help="sharded checkpoint: resumed from if it exists, then saved")
    args = parser.parse_args()
    strategy = args.strategy
    if strategy.startswith("paro"):  # decoder layers as units (the string names use no wrap policy)
        code = strategy.removeprefix("paro").removeprefix("_") or "auto"
        tokens = args.micro_batch * args.seq  # per rank and step of the module: auto predicts the compute too
        strategy = ParoStrategy(code, wrap_policy={LlamaDecoderLayer}, tokens_per_micro_step=tokens)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                        num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                        strategy=strategy, precision=args.precision, max_steps=args.steps,
                        accumulate_grad_batches=args.grad_accum, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1)  # fmt: skip
    L.seed_everything(0)
    model = LanguageModel(lr=3e-3)
    data = DataLoader(Windows(args.seq), batch_size=args.micro_batch, shuffle=True, drop_last=True)
    resume = args.checkpoint if args.checkpoint is not None and args.checkpoint.exists() else None
    trainer.fit(model, data, ckpt_path=resume)
    if args.checkpoint is not None:
        trainer.save_checkpoint(args.checkpoint)
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps, loss {trainer.callback_metrics['loss'].item():.4f}")


if __name__ == "__main__":
    main()
