"""Peak memory of a training step on common model shapes, measured, against a chain of as many blocks.

Usage: engine_memory.py STRATEGY[,STRATEGY...]; world 4 as 2 groups of 2 (PARO_GROUP_SIZE=2), run with
MALLOC_MMAP_THRESHOLD_ set so that freed tensors leave the resident set. A step's peak is the growth of the peak
resident set (VmHWM, reset through /proc/self/clear_refs) over the resident set before it, on every rank, in
forward and in the whole step, in blocks (1024 x 1024 float32: 4 MiB; activations are tiny), taken in
steps 3 and 4 (the run order is agreed in the first; the least of the two on each rank, the most over ranks).
Backward is slowed to several times a reduction, so that gradients do not wait on a lagging lane. Each shape's
peak may exceed that of a chain of seven blocks run in registration order (the schedule's own need: the root,
the computing block, one ahead, gradients on their way to the reduction lane) by a fraction of a block in forward
and three blocks in the step (lane timing under load: up to 2.5 measured). Shapes:
- unet: three down blocks, mid, the three up blocks in reverse, registered as down, up, mid: gathers follow the
  run order, not the registration order (before: 6 blocks at once in forward);
- tower: a vision tower of two blocks no rank runs (text-only batches) beside six text blocks: not gathered;
- skipped: rank 1 skips the last text block: the text blocks before it reduce their gradients as they complete,
  not when that rank's backward ends (before: five blocks' gradients held on rank 1);
- two_forwards: the chain run twice (each half of the batch) before one backward: each forward's backward gathers
  and reduces each block on its own (before: every block gathered, and its gradient held, through backward).
Then the memory ``.grad`` takes beyond the gradient accumulator, in blocks: under half a block (it is a view of it).
"""

import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from paro_torch import ParoShardedModule

WIDTH = 1024
BLOCK = WIDTH * WIDTH * 4  # bytes of one block's parameters
BACKWARD_S = 0.15  # a block's backward at least this long: several times a reduction of its gradient here


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x + self.fc(x)
        if out.requires_grad:  # backward slower than a reduction, so that none waits on the lane for its turn
            out.register_hook(slow_backward)
        return out


def slow_backward(grad: torch.Tensor) -> torch.Tensor:
    time.sleep(BACKWARD_S)
    return grad


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(7))
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x * self.scale


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList(Block() for _ in range(3))
        self.up = nn.ModuleList(Block() for _ in range(3))
        self.mid = Block()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.down:
            x = b(x)
        x = self.mid(x)
        for b in reversed(self.up):
            x = b(x)
        return x * self.scale


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.ModuleList(Block() for _ in range(2))
        self.text = nn.ModuleList(Block() for _ in range(6))
        self.scale = nn.Parameter(torch.ones(()))
        self.skip: int | None = None

    def forward(self, x: torch.Tensor, images: torch.Tensor | None = None) -> torch.Tensor:
        if images is not None:
            for b in self.vision:
                images = b(images)
            x = x + images
        for i, b in enumerate(self.text):
            if i != self.skip:
                x = b(x)
        return x * self.scale


class InlineLane:
    """Runs each call at once on the calling thread (the engine's CPU lanes are threads)."""

    class Done:
        def __init__(self, value: object) -> None:
            self.value = value

        def result(self) -> object:
            return self.value

    def submit(self, fn: Callable[..., object], *args: object, **kwargs: object) -> "InlineLane.Done":
        return InlineLane.Done(fn(*args, **kwargs))


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def step(model: ParoShardedModule, x: torch.Tensor, forwards: int = 1) -> tuple[float, float]:
    """One training step; the peak growth over the resident set before it, in blocks, in forward and in all.

    ``forwards``: forwards before the one backward (halves of the batch), as a reward model's chosen and rejected.
    """
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    start = status("VmRSS")
    loss = sum(model(part).square().mean() for part in x.chunk(forwards))
    forward = status("VmHWM") - start
    loss.backward()
    whole = status("VmHWM") - start
    del loss
    return forward / BLOCK, whole / BLOCK


SHAPES = {"chain": Chain, "unet": UNet, "tower": Tower, "skipped": Tower, "two_forwards": Chain}
SLACK = (0.75, 3.0)  # blocks above the chain's peak: in forward, in the whole step (before: +3.6 to +4.9)


def peak(shape: str, code: str) -> tuple[float, float]:
    """The shape's peaks (forward, step) in blocks: the least of steps 3 and 4 on each rank (the lanes' timing
    adds to single steps), the most over ranks."""
    torch.manual_seed(0)
    rank = dist.get_rank()
    inner = SHAPES[shape]()
    if shape == "skipped" and rank == 1:
        inner.skip = len(inner.text) - 1
    model = ParoShardedModule(inner, code, wrap_policy={Block})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(2, WIDTH)
    peaks = []
    for _ in range(4):
        peaks.append(step(model, x, 2 if shape == "two_forwards" else 1))
        opt.step()
        opt.zero_grad()
    del model, opt
    gc.collect()
    least = torch.tensor([min(p[k] for p in peaks[2:]) for k in range(2)], dtype=torch.float64)
    dist.all_reduce(least, op=dist.ReduceOp.MAX)
    return least[0].item(), least[1].item()


def gradient_growth(code: str) -> float:
    """Blocks the resident set grew by from after construction (the engine's accumulator included) to after the
    third step's backward (gradients held; the loss, activations and gathered parameters freed): memory gradients
    take beyond the accumulator (before: a copy at os's layout where g != os, 1.75 blocks in IIG)."""
    torch.manual_seed(0)
    model = ParoShardedModule(Chain(), code, wrap_policy={Block})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # no optimizer states
    x = torch.randn(2, WIDTH)
    gc.collect()
    built = status("VmRSS")
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    gc.collect()
    out = torch.tensor([(status("VmRSS") - built) / BLOCK], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.item()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    problems = []
    for code in sys.argv[1].split(","):
        chain = peak("chain", code)
        if rank == 0:
            print(f"{code} chain: peak {chain[0]:.2f} blocks in forward, {chain[1]:.2f} in the step")
        for shape in ("unet", "tower", "skipped", "two_forwards"):
            got = peak(shape, code)
            if rank == 0:
                print(f"{code} {shape}: peak {got[0]:.2f} blocks in forward, {got[1]:.2f} in the step")
            for phase, g, c, slack in zip(("forward", "the step"), got, chain, SLACK, strict=True):
                if g > c + slack:
                    problems.append(f"{code} {shape}: {g:.2f} blocks in {phase}, the chain {c:.2f}")
        grown = gradient_growth(code)
        if rank == 0:
            print(f"{code} gradients: {grown:.2f} blocks beyond the accumulator")
        if grown > 0.5:
            problems.append(f"{code}: gradients hold {grown:.2f} blocks beyond the accumulator")
    dist.barrier()
    dist.destroy_process_group()
    if problems:
        sys.exit("\n".join(problems))


if __name__ == "__main__":
    main()
