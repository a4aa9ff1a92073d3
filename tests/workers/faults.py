"""A rank killed (SIGKILL) mid-step or mid-save ends the job with an error on every other rank; the last complete
checkpoint then resumes training exactly as an uninterrupted run (docs/checkpoints.md, "When a rank dies").

Usage: faults.py ENGINE PHASE DIR [DIR ...]
  ENGINE: paro (ParoShardedModule, IIG) or ddp (DistributedDataParallel), both on the ``paro`` backend
  PHASE:  forward, backward, optimizer or save: rank 1 kills itself there in step KILL_STEP (in the save after it)
          after saving DIR/ckpt-ENGINE every SAVE_EVERY steps
  resume: a new job loads each DIR/ckpt-ENGINE into a new model, trains it to STEPS and compares it with one
          uninterrupted run: they must be equal
"""

import datetime
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from engine import SEQ, VOCAB, Block, loss_fn, make
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from paro_torch import ParoShardedModule
from paro_torch.checkpoint import load_checkpoint, read_extra, save_checkpoint

STEPS, SAVE_EVERY, KILL_STEP, GLOBAL_BATCH = 6, 2, 3, 8
TIMEOUT_S = 20
progress = {"step": -1}  # the step being run (and saved after it)


def build(engine: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make("plain")
    if engine == "paro":
        model = ParoShardedModule(model, "IIG", wrap_policy={Block})
    else:
        model = DDP(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def save(engine: str, path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    if engine == "paro":
        save_checkpoint(path, model, opt, extra={"step": step})
        return
    # DDP: torch's own DCP API; rank 0 renames the save into place once every rank has written its part
    partial = path.with_name(path.name + ".partial")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)
    dist.barrier()


def load(engine: str, path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    if engine == "paro":
        load_checkpoint(path, model, opt)
        return read_extra(path)["step"]
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "step": -1}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["step"]


def train(engine: str, model: nn.Module, opt: torch.optim.Optimizer, steps: range, ckpt: Path | None) -> None:
    """The same batches in every run: each rank takes its slice of step's global batch."""
    rank, per = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    for step in steps:
        progress["step"] = step
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
        loss_fn(model, x[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
        if ckpt is not None and (step + 1) % SAVE_EVERY == 0:
            save(engine, ckpt, model, opt, step)


def arm(phase: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Rank 1 kills itself (SIGKILL: no cleanup, no goodbye to its peers) in ``phase`` of step KILL_STEP."""

    def kill(*_: object) -> None:
        if progress["step"] == KILL_STEP:
            print(f"rank 1: killed in {phase} of step {KILL_STEP}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    inner = model.module if isinstance(model, DDP) else model
    if phase == "forward":
        inner.blocks[1].register_forward_pre_hook(kill)
    elif phase == "backward":
        inner.blocks[0].register_full_backward_pre_hook(kill)
    elif phase == "optimizer":
        opt.register_step_pre_hook(kill)
    elif phase == "save":
        write_data = dcp.FileSystemWriter.write_data

        def killing_write(self, *args, **kwargs):  # noqa: ANN001, ANN202
            kill()
            return write_data(self, *args, **kwargs)

        dcp.FileSystemWriter.write_data = killing_write


def states(engine: str, model: nn.Module) -> dict[str, torch.Tensor]:
    return model.full_state_dict() if engine == "paro" else model.module.state_dict()


def main() -> None:
    engine, phase, dirs = sys.argv[1], sys.argv[2], [Path(d) for d in sys.argv[3:]]
    dist.init_process_group("paro", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    if phase != "resume":
        model, opt = build(engine)
        if rank == 1:
            arm(phase, model, opt)
        train(engine, model, opt, range(STEPS), dirs[0] / f"ckpt-{engine}")
        print(f"rank {rank}: finished without an error")
        sys.exit(1)
    reference, ref_opt = build(engine)
    train(engine, reference, ref_opt, range(STEPS), None)
    want = states(engine, reference)
    for out in dirs:
        model, opt = build(engine)
        first = load(engine, out / f"ckpt-{engine}", model, opt) + 1
        train(engine, model, opt, range(first, STEPS), None)
        resumed = states(engine, model)
        for name, w in want.items():
            assert torch.equal(resumed[name], w), f"{out}: {name} differs by {(resumed[name] - w).abs().max()}"
        print(f"rank {rank}: {out.name}: resumed at step {first}, equal to the uninterrupted run after {STEPS} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
