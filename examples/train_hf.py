"""Train a small LLaMA with the Hugging Face Trainer on PaRO-DP: ``ParoTrainer(..., strategy="auto")``.

    PARO_GROUP_SIZE=2 torchrun --standalone --nproc-per-node 4 examples/train_hf.py --output-dir out

The only change to an ordinary Trainer script is the class (and its ``strategy``). ``trainer.save_model`` writes a
model that ``LlamaForCausalLM.from_pretrained`` loads; ``--resume`` continues from the last checkpoint, also with
another number of ranks or another strategy.
"""

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from paro_torch.trainer import ParoTrainer


class Chunks(torch.utils.data.Dataset):
    """Fixed-length pieces of the repository's documentation, as bytes (a corpus that ships with the repo)."""

    def __init__(self, seq: int) -> None:
        root = Path(__file__).resolve().parent.parent
        text = b"\n".join(p.read_bytes() for p in sorted(root.glob("*.md")))
        self.data, self.seq = torch.tensor(list(text), dtype=torch.long), seq

    def __len__(self) -> int:
        return self.data.numel() // self.seq

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i * self.seq : (i + 1) * self.seq]
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--output-dir", default="out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=5,
        save_steps=10,
        report_to=[],
        use_cpu=True,
    )
    trainer = ParoTrainer(
        model=LlamaForCausalLM(config), args=training_args, train_dataset=Chunks(64), strategy=args.strategy
    )
    trainer.train(resume_from_checkpoint=args.resume or None)
    trainer.save_model(args.output_dir)  # on every rank (it gathers); rank 0 writes


if __name__ == "__main__":
    main()
