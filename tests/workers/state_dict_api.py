"""torch's own views of the sharded parameters give the trained model, for every strategy, uneven shapes included.

Usage: state_dict_api.py check DIR (4 ranks as 2 x 2) | load DIR (1 or 2 ranks, no paro_torch)
  check: per strategy, the values each rank got at construction (rank 0's, each rank built with its own seed) and
         the bytes it received; ``clip_grad_norm_`` (inf and 2) against one process; after one AdamW step:
         ``full_tensor()`` of every entry of ``state_dict()``, ``get_model_state_dict`` with full and with sharded
         options, ``set_model_state_dict`` with full and with sharded state dicts, all against
         ``full_state_dict()``; then ``dcp.save`` of the sharded state dict to DIR/<code> and the expected whole
         tensors to DIR/<code>.pt (rank 0)
  load:  each DIR/<code> read by ``dcp.load`` into a plain module (whole tensors) on this world: equal to DIR/<code>.pt
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

STRATEGIES = ["NNN", "NNI", "NNG", "NII", "NIG", "NGG", "INI", "ING", "III", "IIG", "IGG", "GNG", "GIG", "GGG"]


class Block(nn.Module):
    """Rows that do not divide 4 ranks (7, 5, 3), fewer rows than ranks (1, 2: empty shards) and a 0-dim scale."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(5, 7)
        self.down = nn.Linear(7, 5)
        self.gate = nn.Parameter(torch.randn(2, 5))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x))) * self.scale + self.gate.sum(0)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 5)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(5, 3)
        self.row = nn.Parameter(torch.randn(1, 5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.row
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def check(out: Path) -> None:
    from paro_torch import ParoShardedModule

    rank = dist.get_rank()
    failures = []
    torch.manual_seed(0)
    initial = Model().state_dict()  # rank 0's model
    grads, norms = reference_clipping(initial, dist.get_world_size())
    for code in STRATEGIES:
        torch.manual_seed(rank)  # each rank its own values: rank 0's must win
        model = ParoShardedModule(Model(), code, wrap_policy={Block})
        failures += differ(code, initial, model.full_state_dict(), "the values after construction (rank 0's)")
        got, want_bytes = model.startup_received, startup_bytes(model)
        if got != want_bytes:
            failures.append(f"{code}: rank {rank} received {got} bytes of rank 0's values at start, not {want_bytes}")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 13, (4, 6), generator=torch.Generator().manual_seed(rank))
        model(ids).square().mean().backward()
        for norm_type, max_norm, want_norm in norms:  # empty gradient shards included
            norm = model.clip_grad_norm_(max_norm, norm_type).item()
            if abs(norm - want_norm) > 1e-6 * want_norm:
                failures.append(f"{code}: clip_grad_norm_(norm_type={norm_type}) gave {norm}, not {want_norm}")
        clipped = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        worst = max((clipped[n] - g).abs().max().item() for n, g in grads.items())
        if clipped.keys() != grads.keys() or worst > 1e-6 * norms[0][1]:  # sums over ranks: rounding apart
            failures.append(f"{code}: gradients after clip_grad_norm_ (inf, then 2) differ by {worst:.3g}")
        opt.step()
        opt.zero_grad()
        want = model.full_state_dict()

        local = model.state_dict()
        failures += differ(code, want, whole(local), "full_tensor()")
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        failures += differ(code, want, full, "get_model_state_dict(full_state_dict=True)")
        sharded = sharded_copy(get_model_state_dict(model))  # a copy: its DTensors view the masters
        failures += differ(code, want, whole(sharded), "get_model_state_dict (sharded), full_tensor()")
        # set: full tensors (another model's values), then the sharded state dict taken before: back to want
        other = {k: v + 1.0 for k, v in want.items()}
        # (torch distributes the given dict's tensors in place: pass a copy)
        set_model_state_dict(model, dict(other), options=StateDictOptions(full_state_dict=True))
        got = model.full_state_dict()
        if any(not torch.equal(got[k], other[k]) for k in want):
            failures.append(f"{code}: set_model_state_dict(full_state_dict=True) did not load the whole tensors")
        set_model_state_dict(model, {k: v.detach().clone() if not isinstance(v, DTensor) else v for k, v in
                                     get_model_state_dict(model).items()})  # fmt: skip
        restored = {k: (v - 1.0) for k, v in model.full_state_dict().items()}
        if any((restored[k] - want[k]).abs().max() > 1e-6 for k in want):
            failures.append(f"{code}: set_model_state_dict with the sharded state dict changed the values")
        set_model_state_dict(model, sharded)
        failures += differ(code, want, model.full_state_dict(), "set_model_state_dict(sharded)")
        # a forward after the loads computes with them (the masters reached the parameters)
        with torch.no_grad():
            after = model(ids)
        plain = Model()
        plain.load_state_dict(want)
        with torch.no_grad():
            if not torch.allclose(after, plain(ids), atol=1e-6):
                failures.append(f"{code}: the forward after set_model_state_dict differs from the loaded values")
        dcp.save(get_model_state_dict(model), checkpoint_id=out / code)
        if rank == 0:
            torch.save(want, out / f"{code}.pt")
        print(f"{code}: ok" if not failures else failures[-1], flush=True)
    assert not failures, "\n".join(failures)


def reference_clipping(initial: dict, world: int) -> tuple[dict, list[tuple[float, float, float]]]:
    """One process: the ranks' mean gradient clipped to half its inf norm, then to half its 2-norm.

    Returns the clipped gradients and (norm_type, max_norm, the norm before clipping) per clip.
    """
    ref = Model()
    ref.load_state_dict(initial)
    for r in range(world):
        ids = torch.randint(0, 13, (4, 6), generator=torch.Generator().manual_seed(r))
        (ref(ids).square().mean() / world).backward()
    norms = []
    for norm_type in (float("inf"), 2.0):
        total = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type).item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), total / 2, norm_type)
        norms.append((norm_type, total / 2, total))
    return {n: p.grad for n, p in ref.named_parameters()}, norms


def startup_bytes(model: nn.Module) -> dict[str, int]:
    """What each rank should receive of rank 0's values (see [Note: start-up scatter] in paro_torch/_engine/init.py):
    its I-chunk inside group 0, its chunk (p = I, N) or G-block (p = G) over the slow link elsewhere, and at p = N
    its group's other chunks; a buffer laid out whole (level N) by broadcast."""
    rank, m, n = dist.get_rank(), 2, 4
    out = {"intra": 0, "inter": 0, "whole": 0}
    for b in model._flat_buffers:
        p = b.strategy.p
        if b.level == "N":
            out["whole"] += sum(s.numel for s in b.slots) * 4 if rank else 0
            continue
        whole = b.padded * 4  # float32 masters
        out["intra"] += whole // m if rank // m == 0 and rank else 0
        out["inter"] += (whole // n if p == "G" else whole // m) if rank // m else 0
        out["intra"] += whole - whole // m if p == "N" else 0
    return out


def whole(sd: dict) -> dict:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}


def differ(code: str, want: dict, got: dict, what: str) -> list[str]:
    bad = [k for k in want if k in got and not torch.equal(got[k], want[k])]
    if bad or got.keys() != want.keys():
        return [f"{code}: {what} differs in {bad[:4]} (keys {sorted(got.keys() ^ want.keys())})"]
    return []


def sharded_copy(sd: dict) -> dict:
    """The sharded state dict's values copied (DTensors with their own local tensors)."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(v.to_local().clone(), v.device_mesh, v.placements, run_check=False,
                                        shape=v.shape, stride=v.stride())  # fmt: skip
        else:
            out[k] = v.clone()
    return out


def load(out: Path) -> None:
    assert "paro_torch" not in sys.modules, "the checkpoints must load into plain modules without paro_torch"
    for code in STRATEGIES:
        model = Model()
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=out / code)
        want = torch.load(out / f"{code}.pt")
        bad = [k for k in want if not torch.equal(sd[k], want[k])]
        assert not bad, f"{code}: dcp.load into a plain module on {dist.get_world_size()} ranks differs in {bad}"
    print(f"loaded {len(STRATEGIES)} checkpoints on {dist.get_world_size()} ranks", flush=True)


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    (check if phase == "check" else load)(out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
