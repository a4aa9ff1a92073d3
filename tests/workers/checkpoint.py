"""Sharded checkpoints: save under one strategy and world size, load under others, continue training.

Usage: checkpoint.py PHASE DIR [STRATEGY]
  train-save: train STEPS steps, save DIR/ckpt, train STEPS more, write DIR/final-<world>.pt (rank 0)
  load-train: load DIR/ckpt, save it again as DIR/resaved-<world>, train STEPS more, write DIR/final-<world>.pt
  interrupt:  save DIR/interrupted (complete), then save over it with rank 1 dying midway
  verify:     (1 rank) DIR/interrupted still loads as the first save; DIR/interrupted.partial and an
              incompatible model fail with clear errors
  dcp-save, dcp-load: as train-save and load-train, through torch's own API (get_state_dict, dcp.save/load,
              set_state_dict) into DIR/dcp; write DIR/final-dcp-<world>.pt
"""

import datetime
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from engine import SEQ, VOCAB, Block, loss_fn, make
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from paro_torch import ParoShardedModule
from paro_torch.checkpoint import export_safetensors, load_checkpoint, save_checkpoint

STEPS, GLOBAL_BATCH = 2, 8


def wrapped(strategy: str) -> tuple[ParoShardedModule, torch.optim.Optimizer]:
    model = ParoShardedModule(make("frozen"), strategy, wrap_policy={Block})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: ParoShardedModule, opt: torch.optim.Optimizer, first_step: int) -> None:
    """The same global batches at any world size: each rank takes its slice of step's batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    for step in range(first_step, first_step + STEPS):
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
        loss_fn(model, x[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def write_final(model: ParoShardedModule, out: Path) -> None:
    full = model.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(full, out / f"final-{dist.get_world_size()}.pt")


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    strategy = sys.argv[3] if len(sys.argv) > 3 else "IIG"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    world = dist.get_world_size()
    model, opt = wrapped(strategy)
    if phase == "train-save":
        train(model, opt, 0)
        save_checkpoint(out / "ckpt", model, opt)
        export_safetensors(model, out / "ckpt.safetensors")
        train(model, opt, STEPS)
        write_final(model, out)
    elif phase == "load-train":
        load_checkpoint(out / "ckpt", model, opt)
        save_checkpoint(out / f"resaved-{world}", model, opt)
        train(model, opt, STEPS)
        write_final(model, out)
    elif phase in ("dcp-save", "dcp-load"):
        if phase == "dcp-save":
            train(model, opt, 0)
        model_sd, optim_sd = get_state_dict(model, opt)  # DTensors under the model's own names
        state = {"model": model_sd, "optim": optim_sd}
        if phase == "dcp-save":
            dcp.save(state, checkpoint_id=out / "dcp")
        else:
            dcp.load(state, checkpoint_id=out / "dcp")
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train(model, opt, STEPS)
        full = model.full_state_dict()
        if dist.get_rank() == 0:
            torch.save(full, out / f"final-dcp-{world}.pt")
    elif phase == "interrupt":
        train(model, opt, 0)
        save_checkpoint(out / "interrupted", model, opt)
        if dist.get_rank() == 0:
            torch.save(model.full_state_dict(), out / "interrupted-expected.pt")
        else:
            model.full_state_dict()
        train(model, opt, STEPS)
        if dist.get_rank() == 1:

            def die(*args: object, **kwargs: object) -> None:
                os._exit(3)

            dcp.FileSystemWriter.write_data = die  # type: ignore[method-assign]
        save_checkpoint(out / "interrupted", model, opt)
        raise AssertionError("the interrupted save returned")
    elif phase == "verify":
        load_checkpoint(out / "interrupted", model, opt)
        want = torch.load(out / "interrupted-expected.pt")
        got = model.full_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), "the earlier complete checkpoint changed"
        expect_error(lambda: load_checkpoint(out / "interrupted.partial", model, opt), "not a complete")
        other = ParoShardedModule(torch.nn.Sequential(torch.nn.Linear(4, 4)), "NNN")
        expect_error(lambda: load_checkpoint(out / "interrupted", other), "does not match the model")
        # a shard file cut short, or one byte changed: refused, naming the file
        for damage, text in (("truncate", "is truncated"), ("flip", "is corrupted")):
            bad = out / f"damaged-{damage}"
            shutil.copytree(out / "interrupted", bad)
            shard = sorted(bad.glob("*.distcp"))[-1]
            data = bytearray(shard.read_bytes())
            if damage == "truncate":
                data = data[: len(data) - 7]
            else:
                data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
            expect_error(lambda bad=bad: load_checkpoint(bad, model, opt), text)
        print("verify ok", flush=True)
    dist.destroy_process_group()


def expect_error(fn: object, text: str) -> None:
    try:
        fn()  # type: ignore[operator]
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        assert text in str(e), e
        print(f"expected error: {e}", flush=True)
        return
    raise AssertionError(f"no error containing {text!r}")


if __name__ == "__main__":
    main()
    # skip the interpreter's teardown: an intermittent "terminate called without an active exception" there
    # (a clean-exit failure, seen here with plain Gloo groups) would fail a run whose checks all passed
    sys.stdout.flush()
    os._exit(0)
