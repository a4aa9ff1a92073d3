"""ParoShardedModule on the paths real training takes trains to the parameters (and buffers) of one process.

Usage: engine_paths.py CASE[,CASE...] [STRATEGY ...] (cases in one process, one after another); world 4 as 2
groups of 2 (PARO_GROUP_SIZE=2). CASE in: fused, foreach, sgd, adam_l2 (optimizers); skipped_step (a
GradScaler-style skipped optimizer step); dropped_equal, dropped_unequal (a block unused on one rank for one
step); reversed (blocks run last to first); two_forwards (two forwards, one backward); dormant (a block unused
everywhere, then on one rank only); ckpt_nonreentrant_early, ckpt_nonreentrant_late, ckpt_reentrant (activation
checkpointing); retain_graph; batchnorm (buffers); seeds (ranks built with different seeds);
buffer_changes (a buffer the forward uses, constant but for one change between steps: broadcast only when changed);
param_groups (optimizer groups by the original parameter names); meta (built on the meta device, initialised by
param_init_fn unit by unit); backward_error (a backward that raises midway on every rank, the step skipped);
direct_call (the inner model called past the wrapper between steps, as Hugging Face's generate does, and a
generate that reaches the forward past the inner model's own hooks, as PEFT's does); nested (Lightning's
redirection: the wrapper's forward runs training_step, which calls the model again and uses a root parameter);
forward_error (a forward that raises inside a block on every rank, that micro-step skipped);
inference_first (the first forward under inference_mode with communication issued on the calling thread, as on
CUDA); edit_after_eval (after step 1, an evaluation forward, then every parameter halved in place, as an EMA swap
or schedule-free's train() does); moved (``.to``, ``.cpu``, ``.float``, ``.double().float()`` between steps; a device
change refused);
abandoned_window, abandoned_window_inplace (a window dropped after its first micro-step by a NaN guard:
zero_grad() with set_to_none True, then False, and no step); zero_grad_inplace (every zero_grad(set_to_none=False));
user_collectives (the user's own all-reduces on the groups the model was given, in every block's forward hook and
in backward, while the engine's lanes gather and reduce: the engine uses communicators of its own); input_grad
(an adversarial step: torch.autograd.grad of the loss to the inputs, then the loss on the perturbed inputs);
grad_penalty (the loss plus a penalty on the gradient to the inputs, taken with create_graph=True).
Every case also checks that no module attribute points at freed parameter storage between steps, and that the
module is freed once dropped.
"""

import contextlib
import faulthandler
import gc
import os
import shutil
import sys
import tempfile
import traceback
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import paro_torch._engine.init as engine_init
from paro_torch import ParoShardedModule
from paro_torch._groups import ParoGroups, build_groups
from paro_torch.checkpoint import load_checkpoint, save_checkpoint

STEPS, ACCUM, BATCH, DIM, CLASSES = 4, 2, 4, 8, 5
TOL = 1e-5
STRATEGIES = ["NNN", "NNG", "NGG", "IIG", "GGG"]
SKIP_STEP = 1  # skipped_step: no optimizer step here; dropped_*: SKIP_RANK leaves out block SKIP_BLOCK here
SKIP_RANK, SKIP_BLOCK = 1, 1
# the reference runs each rank's share on its own
PER_RANK = ("dropped_equal", "dropped_unequal", "dormant", "batchnorm")
ABANDONED = ("abandoned_window", "abandoned_window_inplace")  # SKIP_STEP's window dropped before its last micro-step
CHECKPOINT = {"ckpt_nonreentrant_early": False, "ckpt_nonreentrant_late": False, "ckpt_reentrant": True}
WATCHDOG_S = 150  # a hung collective: dump every thread's stack and exit, before the test's 180 s kill


class Block(nn.Module):
    def __init__(self, hidden: int, bn: bool) -> None:
        super().__init__()
        # no bias ahead of a BatchNorm (here or via fc1): its gradient is exactly zero, and Adam turns the rounding
        # noise of that zero into full-size steps
        self.norm = nn.LayerNorm(DIM, bias=not bn)
        self.fc1 = nn.Linear(DIM, hidden, bias=not bn)
        self.bn = nn.BatchNorm1d(hidden) if bn else None
        self.fc2 = nn.Linear(hidden, DIM)
        self.calls = 0  # forward runs, recomputations included

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc1(self.norm(x))
        if self.bn is not None:
            h = self.bn(h)
        return x + self.fc2(F.gelu(h))


class Tiny(nn.Module):
    def __init__(self, hidden: tuple[int, ...], bn: bool, shift: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM, bias=not bn)  # the blocks' input requires grad (reentrant checkpointing)
        self.bn = nn.BatchNorm1d(DIM) if bn else None  # a BatchNorm in the root unit too
        self.blocks = nn.ModuleList([Block(h, bn) for h in hidden])
        self.head = nn.Linear(DIM, CLASSES)
        # seeds: a random buffer the forward uses, so a rank that keeps its own buffers computes other gradients
        self.register_buffer("shift", torch.randn(DIM) if shift else None)
        self.use_reentrant: bool | None = None  # None: no activation checkpointing
        self.reverse = False  # run the blocks last to first (not in registration order)

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        if self.shift is not None:
            x = x + self.shift
        x = self.inp(x)
        if self.bn is not None:
            x = self.bn(x)
        blocks = list(enumerate(self.blocks))
        for i, b in reversed(blocks) if self.reverse else blocks:
            if i == skip:
                continue
            # as HF's gradient checkpointing: the whole block call (its hooks included) is checkpointed
            x = b(x) if self.use_reentrant is None else checkpoint(b, x, use_reentrant=self.use_reentrant)
        return self.head(x)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Calls the model itself, as Hugging Face's ``generate`` does (reached through the wrapper's __getattr__)."""
        return self(x)

    def generate(self, x: torch.Tensor, synced_gpus: bool = False) -> torch.Tensor:
        """Runs the forward past this module's own hooks, as PEFT's ``generate`` reaches the base model."""
        self.synced_gpus = synced_gpus  # Hugging Face's: every rank runs forwards until all are done
        return self.forward(x)

    def training_step(self, x: torch.Tensor, y: torch.Tensor, skip: int | None) -> torch.Tensor:
        """As a LightningModule's: calls the model, and uses a root parameter of its own (a whole tensor)."""
        return loss_fn(self(x, skip=skip), y) + 0.0 * self.head.weight.sum()


class InlineLane:
    """Runs each call at once on the calling thread, as the engine's CUDA lanes do (its CPU lanes use threads)."""

    class Done:
        def __init__(self, value: object) -> None:
            self.value = value

        def result(self) -> object:
            return self.value

    def submit(self, fn: Callable[..., object], *args: object, **kwargs: object) -> "InlineLane.Done":
        return InlineLane.Done(fn(*args, **kwargs))


def make(case: str, seed: int = 0, device: str = "cpu") -> Tiny:
    """The case's model. ``meta``: its modules initialised by ``init_by_name`` (built on ``device``, uninitialised)."""
    torch.manual_seed(seed)
    # dropped_unequal: the skipped block (1) has more parameters than block 0
    hidden = (2 * DIM, 3 * DIM) if case == "dropped_unequal" else (2 * DIM, 2 * DIM)
    with torch.device(device):
        model = Tiny(hidden, bn=case == "batchnorm", shift=case in ("seeds", "buffer_changes"))
    model.reverse = case == "reversed"
    if case == "meta" and device != "meta":
        init = init_by_name(model)
        for m in model.modules():
            init(m)
    return model


def init_by_name(model: nn.Module) -> Callable[[nn.Module], None]:
    """Initialises a module by its name's own seed: the same values whatever order modules are initialised in."""
    names = {id(m): n for n, m in model.named_modules()}

    def init(m: nn.Module) -> None:
        torch.manual_seed(zlib.crc32(names[id(m)].encode()))
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()

    return init


def make_optimizer(case: str, model: nn.Module) -> torch.optim.Optimizer:
    if case == "fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    if case == "foreach":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, foreach=True)
    if case == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if case == "adam_l2":
        return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    if case == "param_groups":  # as HF: biases and norms slower and without weight decay
        named = list(model.named_parameters())
        slow = [p for n, p in named if n.endswith("bias") or "norm" in n]
        fast = [p for n, p in named if not (n.endswith("bias") or "norm" in n)]
        return torch.optim.AdamW(
            [{"params": fast, "lr": 1e-2, "weight_decay": 0.1}, {"params": slow, "lr": 1e-3, "weight_decay": 0.0}]
        )
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def skip_of(case: str, step: int, rank: int) -> int | None:
    """The block this rank's forward leaves out (both micro-steps of SKIP_STEP, on SKIP_RANK only)."""
    dropped = case.startswith("dropped") and step == SKIP_STEP and rank == SKIP_RANK
    # dormant: unused on every rank in steps 0 and 1, used on rank 0 only in step 2, everywhere in step 3
    dormant = case == "dormant" and (step < 2 or step == 2 and rank != 0)
    return SKIP_BLOCK if dropped or dormant else None


def steps_optimizer(case: str, step: int) -> bool:
    """False where a GradScaler would have found inf: every rank skips optimizer.step() (zero_grad still runs)."""
    return not (case in ("skipped_step", "backward_error", *ABANDONED) and step == SKIP_STEP)


def skips_micro(case: str, step: int, j: int) -> bool:
    """forward_error: the first micro-step of SKIP_STEP raises in forward and is left out."""
    return case == "forward_error" and step == SKIP_STEP and j == 0


def after_step(case: str, step: int, model: Tiny) -> None:
    """buffer_changes: every rank doubles the constant buffer after step 1 (as a user's schedule might);
    edit_after_eval: every parameter halved in place after step 1 (the paro run evaluates first)."""
    if case == "buffer_changes" and step == 1:
        with torch.no_grad():
            model.shift.mul_(2)
    if case == "edit_after_eval" and step == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)


def evaluate_then_move(case: str, step: int, model: ParoShardedModule, x: torch.Tensor) -> None:
    """edit_after_eval: an evaluation forward between the optimizer step and the edit (it syncs the parameters
    first); moved: the wrapped model converted in place between steps, and a device change refused."""
    if case == "edit_after_eval" and step == 1:
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
    if case == "moved":
        {0: lambda: model.to("cpu"), 1: model.cpu, 2: model.float}.get(step, lambda: model.to(torch.float32))()
        engine = model._engine
        stale = [s.fqn for b in engine.flat_buffers for s, p, v in zip(b.slots, b.params, b._local_views, strict=True)
                 if p._local_tensor is not v or s.module._parameters[s.name] is not p]  # fmt: skip
        assert not stale, f"after a conversion, parameters no longer view the engine's storage: {stale[:4]}"
        params = list(model.parameters())  # the optimizer's
        model.double()  # and back: float32 -> float64 -> float32 is exact
        assert {p.dtype for p in model.parameters()} == {torch.float64}
        model.float()
        assert all(p is q for p, q in zip(model.parameters(), params, strict=True)), "parameter objects replaced"
        stale = [s.fqn for b in engine.flat_buffers for s, p, v in zip(b.slots, b.params, b._local_views, strict=True)
                 if p._local_tensor is not v or p.dtype != torch.float32]  # fmt: skip
        assert not stale, f"after .double().float(), parameters do not view the engine's storage: {stale[:4]}"
        model.module.double()  # the wrapped module itself (Hugging Face's model.to() on the inner model)
        model.module.float()
        stale = [s.fqn for b in engine.flat_buffers for s, p, v in zip(b.slots, b.params, b._local_views, strict=True)
                 if p._local_tensor is not v or p.dtype != torch.float32]  # fmt: skip
        assert not stale, f"after the inner module's .double().float(), parameters left the storage: {stale[:4]}"
        try:
            model.to("meta")
        except ValueError as e:
            assert "build it with device=" in str(e), e
        else:
            raise AssertionError("model.to('meta') on a wrapped model did not raise")


# Buffer broadcasts per step in training (see [Note: buffer broadcast] in paro_torch/_engine/buffer_sync.py): all
# buffers in the first step, then those some rank changed in the step before (BatchNorm's: every forward).
BROADCASTS = {
    "seeds": [ACCUM, 0, 0, 0],
    "buffer_changes": [ACCUM, 0, 0, ACCUM],  # changed after step 1, noticed in step 2, broadcast in step 3
    "batchnorm": [ACCUM] * STEPS,
}


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y)


def case_loss(case: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, skip: int | None = None) -> torch.Tensor:
    """The loss of one micro-batch: plain, or through a backward to the inputs first (input_grad, grad_penalty)."""
    if case == "input_grad":  # per sample, so a rank's slice of the whole batch's perturbation is its own
        x = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(loss_fn(model(x, skip=skip), y), x)
        return loss_fn(model((x + 0.1 * g.sign()).detach(), skip=skip), y)
    if case == "grad_penalty":
        x = x.clone().requires_grad_()
        out = model(x, skip=skip)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return loss_fn(out, y) + 0.1 * g.pow(2).sum(1).mean()
    if case == "two_forwards":  # two forwards, one backward (chosen and rejected, as reward models train)
        h = len(x) // 2
        return (loss_fn(model(x[:h], skip=skip), y[:h]) + loss_fn(model(x[h:], skip=skip), y[h:])) / 2
    return loss_fn(model(x, skip=skip), y)


def train_reference(case: str, data: list, world: int, steps: int = STEPS, plain: bool = False) -> Tiny:
    """One process, no checkpointing. ``plain``: without the case's twist (to show the twist changes the result).

    Whole-batch cases: the loss on the concatenation of all ranks' batches. PER_RANK cases: each rank's share
    through the model on its own (its own skip decision; its own BatchNorm batch statistics), losses averaged
    over ranks, which is what data parallelism computes. BatchNorm running stats: rank 0's are authoritative
    (as DDP's broadcast_buffers, and FSDP's state dict from rank 0), so the reference keeps only the update of
    rank 0's share; ``plain`` keeps every rank's update instead.
    """
    ref = make(case)
    opt = make_optimizer("adamw" if plain and case == "param_groups" else case, ref)
    for step, micro in enumerate(data[:steps]):
        for j, (x, y) in enumerate(micro):
            if skips_micro(case, step, j) and not plain:
                continue
            if case not in PER_RANK:
                (case_loss("plain" if plain else case, ref, x, y) / ACCUM).backward()
                continue
            rank0_buffers = None
            for r in range(world):
                local = slice(r * BATCH, (r + 1) * BATCH)
                skip = None if plain else skip_of(case, step, r)
                (loss_fn(ref(x[local], skip=skip), y[local]) / (world * ACCUM)).backward()
                if r == 0:
                    rank0_buffers = {k: v.clone() for k, v in ref.named_buffers()}
            if not plain and rank0_buffers is not None:
                with torch.no_grad():
                    for k, v in ref.named_buffers():
                        v.copy_(rank0_buffers[k])
        if plain or steps_optimizer(case, step):
            opt.step()
        opt.zero_grad()
        if not plain:
            after_step(case, step, ref)
    return ref


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def check_sensitive(case: str, data: list, world: int, ref: Tiny) -> None:
    """The comparison can fail: one optimizer step more or less, or the case's twist, moves far more than TOL."""
    want = ref.state_dict()
    moved = max_diff(train_reference(case, data, world, steps=STEPS - 1).state_dict(), want)
    assert moved > 100 * TOL, f"{case}: the last step moves the parameters by only {moved:.3g}"
    if case in (
        "skipped_step",
        "dropped_equal",
        "dropped_unequal",
        "dormant",
        "param_groups",
        "batchnorm",
        "buffer_changes",
        "forward_error",
        "backward_error",
        "edit_after_eval",
        "input_grad",
        "grad_penalty",
        *ABANDONED,
    ):
        params = dict(ref.named_parameters())
        other = train_reference(case, data, world, plain=True)
        twist = max_diff(dict(other.named_parameters()), params)
        if case == "batchnorm":  # rank 0's running stats against every rank's
            twist = max_diff(dict(other.named_buffers()), dict(ref.named_buffers()))
        assert twist > 100 * TOL, f"{case}: the case's twist changes the result by only {twist:.3g}"
    if case == "seeds":
        other = make(case, seed=1).state_dict()
        assert max_diff(other, make(case).state_dict()) > 100 * TOL


def train_paro(case: str, code: str, data: list, groups: ParoGroups) -> ParoShardedModule:
    rank = dist.get_rank()
    # seeds: the engine must take rank 0's values; meta: it must initialise the model unit by unit
    inner = make(case, seed=rank if case == "seeds" else 0, device="meta" if case == "meta" else "cpu")
    inner.use_reentrant = CHECKPOINT.get(case)
    init = init_by_name(inner) if case == "meta" else None
    model = ParoShardedModule(
        inner, code, process_groups=(groups.intra, groups.inter), wrap_policy={Block}, param_init_fn=init
    )
    if case == "param_groups":  # the final API: per-parameter shards under the inner module's names
        names = [n for n, _ in model.named_parameters()]
        want = [n for n, _ in make(case).named_parameters()]
        assert sorted(names) == sorted(want), (
            f"{code} (param_groups): ParoShardedModule.named_parameters() gives {names[:4]}..., "
            f"not the inner module's names {want[:4]}...: optimizer groups by name cannot be built"
        )
    opt = make_optimizer(case, model)
    if case == "user_collectives":
        user = [pg for pg in (groups.intra, groups.inter, groups.whole) if pg is not None]
        engine = model._engine
        lanes = [engine.comms.gather_groups, engine.comms.reduce_groups]
        shared = [pg for gs in lanes for pg in (gs.intra, gs.inter, gs.whole) if any(pg is u for u in user)]
        assert not shared, f"{code}: the engine's lanes run collectives on the user's own groups"
        for block in inner.blocks:
            block.register_forward_hook(lambda m, a, out: user_all_reduce(user, out))
    late = set_checkpoint_early_stop(False) if case == "ckpt_nonreentrant_late" else contextlib.nullcontext()
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    if case == "inference_first":
        engine = model._engine
        engine.schedule.lane = engine.reducer.lane = InlineLane()  # type: ignore[assignment]
        with torch.inference_mode():
            model(data[0][0][0][local])
    broadcasts: list[int] = []
    real_broadcast = engine_init.broadcast_from_rank0

    def counted(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
        broadcasts[-1] += 1
        real_broadcast(tensors, group)

    engine_init.broadcast_from_rank0 = counted
    with late, contextlib.ExitStack() as restore:
        restore.callback(setattr, engine_init, "broadcast_from_rank0", real_broadcast)
        for step, micro in enumerate(data):
            broadcasts.append(0)
            for j, (x, y) in enumerate(micro):
                if case in ABANDONED and step == SKIP_STEP and j == ACCUM - 1:
                    break  # a NaN guard drops the window: zero_grad() below, no step
                with model.no_sync() if j < ACCUM - 1 else contextlib.nullcontext():
                    # backward_error: at the boundary micro-step, after the head's and the last block's
                    # reductions went out, a hook at block 0's output raises
                    fails = case == "backward_error" and step == SKIP_STEP and j == ACCUM - 1
                    hook = inner.blocks[0].register_forward_hook(fail_in_backward) if fails else None
                    if skips_micro(case, step, j):  # raises inside block 1, after its parameters were gathered
                        raising = inner.blocks[1].fc2.register_forward_hook(fail_in_forward)
                        try:
                            model(x[local])
                        except RuntimeError as e:
                            assert "injected failure" in str(e), e
                        else:
                            raise AssertionError("the forward that should raise did not")
                        finally:
                            raising.remove()
                        continue
                    if case == "nested":  # as Lightning's _ForwardRedirection
                        loss = redirected(model, inner, x[local], y[local], skip_of(case, step, rank)) / ACCUM
                    else:
                        loss = case_loss(case, model, x[local], y[local], skip_of(case, step, rank)) / ACCUM
                    if hook is not None:
                        hook.remove()
                        try:
                            loss.backward()
                        except RuntimeError as e:
                            assert "injected failure" in str(e), e
                            break  # the step is skipped; zero_grad() below
                        raise AssertionError("the backward that should raise did not")
                    loss.backward(retain_graph=case == "retain_graph" and j == 0)
            if steps_optimizer(case, step):
                opt.step()
            opt.zero_grad(set_to_none=not case.endswith("inplace"))
            evaluate_then_move(case, step, model, data[0][0][0][local])
            after_step(case, step, inner)
            freed = [f"{type(m).__name__}.{k}" for m in inner.modules() for k, v in vars(m).items()
                     if torch.is_tensor(v) and v.numel() and not v.untyped_storage().size()]  # fmt: skip
            assert not freed, f"{code} ({case}): after step {step}, module attributes point at freed storage: {freed}"
            if case == "direct_call" and step < len(data) - 1:  # past the wrapper between steps (main checks
                with torch.no_grad():  # the output after the last step)
                    model.predict(data[0][0][0][local])
    want = BROADCASTS.get(case)
    assert want is None or broadcasts == want, f"{code} ({case}): buffer broadcasts per step {broadcasts}, not {want}"
    if case in CHECKPOINT:  # the test checkpoints for real: every block's forward ran again in backward
        calls = [b.calls for b in inner.blocks]
        assert calls == [2 * STEPS * ACCUM] * len(calls), f"{code} ({case}): blocks ran {calls} times"
    return model


def user_all_reduce(groups: list[dist.ProcessGroup], out: torch.Tensor) -> None:
    """The user's collectives on the groups they passed, now and when backward reaches ``out``: sums of ones."""

    def reduce_all() -> None:
        for pg in groups:
            ones = torch.ones(64)
            dist.all_reduce(ones, group=pg)
            assert torch.equal(ones, torch.full((64,), float(dist.get_world_size(pg)))), "a collective mis-paired"

    reduce_all()
    if out.requires_grad:
        out.register_hook(lambda grad: reduce_all())


def fail_in_forward(module: nn.Module, args: object, out: torch.Tensor) -> None:
    raise RuntimeError("injected failure in forward")


def redirected(model: ParoShardedModule, inner: Tiny, x: torch.Tensor, y: torch.Tensor, skip: int | None) -> object:
    """The wrapper's call runs ``training_step`` in place of the inner model's forward, as Lightning does."""
    original = inner.forward

    def forward(*args: object, **kwargs: object) -> torch.Tensor:
        inner.forward = original  # training_step calls the real forward
        return inner.training_step(x, y, skip)

    inner.forward = forward
    try:
        return model(x)
    finally:
        inner.forward = original


def fail_in_backward(module: nn.Module, args: object, out: torch.Tensor) -> None:
    """A forward hook: backward raises when it reaches the module's output."""

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in backward")

    out.register_hook(fail)


def compare(case: str, code: str, model: ParoShardedModule, ref: Tiny) -> list[str]:
    """What differs between the engine's full state dict and the reference's: names, parameters, buffers."""
    got = model.full_state_dict()
    want = ref.state_dict()  # parameters and (persistent) buffers: BatchNorm running stats, seeds' shift
    params = dict(ref.named_parameters())
    buffers = {k: v for k, v in want.items() if k not in params}
    problems = []
    if got.keys() - want.keys():
        problems.append(f"unexpected names in full_state_dict(): {sorted(got.keys() - want.keys())[:6]}")
    missing = sorted(params.keys() - got.keys())
    if missing:
        problems.append(f"parameters missing from full_state_dict(): {missing[:6]}")
    present = {k: v for k, v in params.items() if k in got}
    worst = max_diff(got, present) if present else 0.0
    if worst >= TOL:
        bad = [k for k in present if max_diff(got, {k: present[k]}) >= TOL]
        problems.append(
            f"parameters differ from single-process training by {worst:.3g} ({len(bad)} of them: {bad[:4]})"
        )
    summary = f"params {worst:.2e}"
    if buffers:
        absent = sorted(buffers.keys() - got.keys())
        if absent:
            problems.append(f"{len(absent)} of {len(buffers)} buffers missing from full_state_dict(): {absent[:4]}")
        else:
            worst_buffer = max_diff(got, buffers)
            summary += f", buffers {worst_buffer:.2e}"
            if worst_buffer >= TOL:
                bad = [k for k in buffers if max_diff(got, {k: buffers[k]}) >= TOL]
                problems.append(f"buffers differ from the reference (rank 0's) by {worst_buffer:.3g}: {bad[:4]}")
    rank = dist.get_rank()
    return [f"{code} ({case}) on rank {rank}: {p}" for p in problems] or [f"ok {summary}"]


def through_checkpoint(case: str, code: str, model: ParoShardedModule, ref: Tiny, groups: ParoGroups) -> list[str]:
    """Saves ``model``, loads it into a fresh model of another strategy (initial buffers) and compares that."""
    path = Path(tempfile.gettempdir()) / f"paro-paths-{os.environ['MASTER_PORT']}-{code}"
    save_checkpoint(path, model)
    other = "GGG" if code != "GGG" else "NNN"
    fresh = ParoShardedModule(make(case), other, process_groups=(groups.intra, groups.inter), wrap_policy={Block})
    load_checkpoint(path, fresh)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    result = compare(case, f"{code} -> checkpoint -> {other}", fresh, ref)
    return [f"{result[0]} (and through a checkpoint)", *result[1:]]


def check_case(case: str, strategies: list[str], groups: ParoGroups) -> list[str]:
    """Trains every strategy on ``case`` and compares each with one process: the problems found."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # per case
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    data = [
        [
            (torch.randn(world * BATCH, DIM, generator=g), torch.randint(0, CLASSES, (world * BATCH,), generator=g))
            for _ in range(ACCUM)
        ]
        for _ in range(STEPS)
    ]
    ref = train_reference(case, data, world)
    check_sensitive(case, data, world, ref)
    failures = []
    for code in strategies:
        model = train_paro(case, code, data, groups)
        result = compare(case, code, model, ref)
        if case == "direct_call" and result[0].startswith("ok "):  # the first call after the last step
            x = data[0][0][0][rank * BATCH : (rank + 1) * BATCH]
            with torch.no_grad():
                off = (model.predict(x) - ref(x)).abs().max().item()
                off = max(off, (model.generate(x) - ref(x)).abs().max().item())
            synced = model.module.synced_gpus
            assert synced == (code[0] != "N"), f"{code}: generate got synced_gpus={synced}"
            if off >= TOL:
                result = [f"{code} ({case}): the inner model called directly is {off:.3g} off the reference"]
        if case == "batchnorm" and result[0].startswith("ok "):  # the buffers go through a DCP checkpoint too
            result = through_checkpoint(case, code, model, ref, groups)
            # under a parent module: the wrapped subtree's shards and buffers, prefixed; no collective
            parent = nn.ModuleDict({"net": model}).state_dict()
            own = model.state_dict()
            assert parent.keys() == {f"net.{k}" for k in own} and any("running_mean" in k for k in own), sorted(parent)
        freed = weakref.ref(model)  # and nothing keeps it (or its communication threads) alive after training
        del model
        gc.collect()
        if freed() is not None:
            result = [f"{code} ({case}): the module outlives its last reference", *result]
        ok = result[0].startswith("ok ")
        failures += [] if ok else result
        if rank == 0:  # every rank checks the same full state dict, and fails with its own message
            print(f"{code} {case}: max |diff| {result[0][3:]}" if ok else "\n".join(result), flush=True)
    dist.barrier()
    return failures


def main() -> None:
    cases, strategies = sys.argv[1].split(","), sys.argv[2:] or STRATEGIES
    dist.init_process_group("gloo")
    groups = build_groups()
    assert dist.get_world_size() == 4 and groups.group_size == 2, "run on 4 ranks with PARO_GROUP_SIZE=2"
    failures = [f for case in cases for f in check_case(case, strategies, groups)]  # one process, case after case
    dist.destroy_process_group()
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # exit now: a collective stuck on the engine's communication thread would keep the process alive (and
        # its peers waiting on its sockets) until the watchdog
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
