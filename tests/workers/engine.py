"""ParoShardedModule with every strategy trains to the parameters of single-process training.

Usage: engine.py VARIANT[,VARIANT...] [STRATEGY ...]; VARIANT in plain, frozen, lora, tied, syncall, clip, bf16, fp16,
mesh, float64 (a float64 model, no policy), double (a float32 model, .double() after wrapping), bf16model (a bfloat16
model, no policy). PARO_TEST_DEVICE=cuda: on CUDA (see _device.py), the engine's groups on NCCL.
"""

import contextlib
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from _device import test_device, world_backend
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import paro_torch
from paro_torch import ParoShardedModule
from paro_torch._groups import ParoGroups, build_groups

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
OWN = {"float64": torch.float64, "double": torch.float64, "bf16model": torch.bfloat16}  # the model's own dtype

STEPS, ACCUM, BATCH, DIM, VOCAB, SEQ = 3, 2, 2, 16, 32, 6
SCALE = 2.0**10  # fp16's (constant) loss scale


class Block(nn.Module):
    def __init__(self, lora: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(
            DIM, 3 * DIM, bias=False
        )  # a key bias has an exactly-zero gradient: Adam amplifies its noise
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.lora = nn.Sequential(nn.Linear(DIM, 2, bias=False), nn.Linear(2, DIM, bias=False)) if lora else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / DIM**0.5, dim=-1) @ v
        x = x + self.proj(att)
        y = self.mlp(x)
        if self.lora is not None:
            y = y + self.lora(x)
        return x + y


class Tiny(nn.Module):
    def __init__(self, lora: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(lora), Block(lora)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make(variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = Tiny(lora=variant == "lora")
    if variant == "frozen":  # about a quarter of the parameters frozen, some inside a block
        for p in [model.embed.weight, model.blocks[0].mlp[0].weight, model.blocks[1].proj.bias]:
            p.requires_grad_(False)
    if variant == "tied":  # the output projection shares the embedding (both in the root unit)
        model.head.weight = model.embed.weight
    if variant == "lora":
        for name, p in model.named_parameters():
            p.requires_grad_("lora" in name)
    if variant in ("float64", "bf16model"):
        model.to(OWN[variant])
    return model


def loss_fn(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def train_reference(variant: str, data: list[list[torch.Tensor]], world: int) -> tuple[nn.Module, list[float]]:
    """One process. Low precision (bf16, fp16): the engine's arithmetic on one process: each rank's share runs
    forward and backward on a low-precision copy of the float32 masters; its gradients are summed in float32 (the
    variants set ``reduce_dtype=float32``), divided by n, accumulated in float32; AdamW updates the masters."""
    ref, norms = make("float64" if variant == "double" else variant), []
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for micro in data:
        low = _low_copy(ref, LOW[variant]) if variant in LOW else None
        for x in micro:
            if low is None:
                (loss_fn(ref, x) / ACCUM).backward()
                continue
            for r in range(world):
                low.zero_grad()
                (loss_fn(low, x[r * BATCH : (r + 1) * BATCH]) / ACCUM * SCALE).backward()
                for p, q in zip(ref.parameters(), low.parameters(), strict=True):
                    if q.grad is not None:
                        g = q.grad.float() / (world * SCALE)
                        p.grad = g if p.grad is None else p.grad + g
        if variant == "clip":
            norms.append(torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.05).item())
        opt.step()
        opt.zero_grad()
    return ref, norms


def _low_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    low = copy.deepcopy(model).to(dtype)
    for p in low.parameters():
        p.grad = None
    return low


def check_variant(variant: str, strategies: list[str], groups: ParoGroups) -> None:
    """Trains every strategy on one variant of the model and compares it with one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.get_default_device()
    g = torch.Generator().manual_seed(1)
    data = [
        [torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=g, device="cpu").to(device) for _ in range(ACCUM)]
        for _ in range(STEPS)
    ]
    ref, ref_norms = train_reference(variant, data, world)
    initial = {k: v.double() for k, v in make(variant).state_dict().items()}
    assert variant != "clip" or min(ref_norms) > 0.05, "the clipping test must clip"
    want = {k: v.double() for k, v in ref.state_dict().items()}
    # low precision: small against how far training moved the parameters (a model that never trains fails)
    update = max((want[k] - initial[k]).abs().max().item() for k in want)
    # a bfloat16 model: the sums of n ranks' rounded gradients differ from one process's by up to 2 bfloat16 ulps of
    # the largest parameters (~1.6e-2 here); its dtypes are checked exactly (check_own_dtype)
    tol = 1e-2 * update if variant in LOW else 0.5 * update if variant == "bf16model" else 1e-5
    tol = 1e-12 if OWN.get(variant) == torch.float64 else tol  # float32 anywhere on the path: ~1e-7
    mesh = None
    if variant == "mesh":  # groups from a 2-D DeviceMesh (outer = inter-group, inner = intra-group), as HSDP
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // groups.group_size, groups.group_size))
    for code in strategies:
        model = ParoShardedModule(
            make(variant),
            code,
            process_groups=None if mesh is not None else (groups.intra, groups.inter),
            device_mesh=mesh,
            wrap_policy={Block},
            mixed_precision=MixedPrecisionPolicy(LOW[variant], reduce_dtype=torch.float32) if variant in LOW else None,
            device=device,
        )
        if variant == "double":
            model.double()  # the masters, compute, gathers and reductions become float64
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # fp16: torch's sharded loss scaler agrees on overflow across ranks (every master shard is checked)
        scaler = ShardedGradScaler(device.type, SCALE, process_group=dist.group.WORLD, enabled=variant == "fp16")
        for step, micro in enumerate(data):
            for j, x in enumerate(micro):
                local = x[rank * BATCH : (rank + 1) * BATCH]
                # "syncall": the boundary sync on every micro-step (no no_sync): the gradients must add up
                with model.no_sync() if j < ACCUM - 1 and variant != "syncall" else contextlib.nullcontext():
                    scaler.scale(loss_fn(model, local) / ACCUM).backward()
            if variant == "clip":
                norm = model.clip_grad_norm_(0.05).item()
                assert abs(norm - ref_norms[step]) < 1e-5 * ref_norms[step], (code, norm, ref_norms[step])
            scaler.step(opt)
            scaler.update()
            if variant in OWN and step == STEPS - 1:  # the model's dtype everywhere, as FSDP2 without a policy
                check_own_dtype(model, opt, OWN[variant])
            opt.zero_grad()
        if model.strategy.p != "N":  # the second block's parameters were gathered while the first computed
            assert model.prefetches >= STEPS * ACCUM - 1, model.prefetches
        else:  # after each optimizer step, every block's t_syncp was queued ahead of its forward (root: at once)
            trained = sum(any(b.trainable for b in u.buffers) for u in model._engine.units[:-1])
            boundaries = STEPS * (ACCUM if variant == "syncall" else 1)  # each is followed by a t_syncp
            assert model.prefetches == (boundaries - 1) * trained, (code, variant, model.prefetches, trained)
        # every trainable buffer's boundary sync was queued during backward, not after it
        syncs = STEPS * (ACCUM if variant == "syncall" else 1) * sum(b.trainable for b in model._flat_buffers)
        assert model.overlapped_syncs == syncs, (code, variant, model.overlapped_syncs, syncs)
        got = model.full_state_dict()
        assert got.keys() == want.keys(), (sorted(got), sorted(want))
        worst = max((got[k].double() - want[k]).abs().max().item() for k in want)
        assert worst < tol, f"{code} ({variant}): parameters differ from single-process training by {worst:.3g}"
        if rank == 0:
            print(f"{code} {variant}: max |diff| {worst:.2e} (update {update:.2e})", flush=True)
    if variant == "bf16":  # the policy's casts: float inputs to param_dtype in every unit, outputs to output_dtype
        seen: list[torch.dtype] = []
        inner = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        inner[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        policy = MixedPrecisionPolicy(torch.bfloat16, output_dtype=torch.float32)
        model = ParoShardedModule(inner, "GGG", process_groups=(groups.intra, groups.inter), mixed_precision=policy,
                                  wrap_policy=lambda m: m is inner[1], device=device)  # fmt: skip
        out = model(torch.randn(2, DIM, dtype=torch.float64))
        assert out.dtype == torch.float32 and seen == [torch.bfloat16], (out.dtype, seen)
        # bfloat16 reductions accumulate in the masters' dtype (float32), as FSDP2 accumulates into .grad
        policy = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.bfloat16)
        model = ParoShardedModule(make("plain"), "IIG", process_groups=(groups.intra, groups.inter),
                                  mixed_precision=policy, wrap_policy={Block}, device=device)  # fmt: skip
        with model.no_sync():
            loss_fn(model, data[0][0][:BATCH]).backward()
        acc = sum(b.g_acc.numel() for b in model._flat_buffers if b.trainable)
        assert model.memory_stats()["grads"] == 4 * acc, (model.memory_stats(), acc)


def check_own_dtype(model: ParoShardedModule, opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Parameters, gradients, accumulators and optimizer states in ``dtype``, measured by ``memory_stats``."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    states = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert grads and states, (len(grads), len(states))
    assert {p.dtype for p in model.parameters()} | {g.dtype for g in grads} | {v.dtype for v in states} == {dtype}
    stats = model.memory_stats(opt)
    numel = sum(b.p_shard.numel() for b in model._flat_buffers), sum(b.g_acc.numel() for b in model._flat_buffers)
    state_numel = sum(v.to_local().numel() for v in states)  # Adam's two states per element of the masters
    s = model.strategy  # masters apart from the parameters only where the layouts differ (p = N keeps its own)
    masters = state_numel // 2 if s.p == "N" and s.os != "N" else 0
    want = {"params": numel[0] * dtype.itemsize, "grads": numel[1] * dtype.itemsize, "optimizer_states":
            (state_numel + masters) * dtype.itemsize}  # fmt: skip
    assert stats == want, (stats, want)


def main() -> None:
    variants, strategies = sys.argv[1].split(","), sys.argv[2:] or paro_torch.STRATEGIES
    dist.init_process_group(world_backend(test_device()))
    groups = build_groups()
    for variant in variants:
        check_variant(variant, strategies, groups)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
