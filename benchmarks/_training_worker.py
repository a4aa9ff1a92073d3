"""One rank of benchmarks/training.py: trains a small LLaMA with one system for a few steps and measures it.

Started by torchrun (one per emulated node, or one on localhost) with ``--bench-config FILE`` written by the driver.
Modes:

- ``calibrate``: ``paro_torch.calibrate(path)`` on this launch's layout (the file every paro run then reads through
  PARO_CALIBRATION).
- ``train``: builds the model (same seed everywhere), makes the scenario's parameters trainable (full, partial or
  LoRA), wraps it with the variant's system (paro_torch, DDP, FSDP1, FSDP2, DeepSpeed), runs warm-up steps, then the
  measured steps (each an optimizer step over ``grad_accum`` micro-batches, a barrier on a separate Gloo group before
  each); local rank 0 of every node reads its link counters from /proc/net/dev around the measured steps.
- ``interleave``: ``train`` for several paro variants in one launch, their measured steps taken in turns (one
  ``run`` record each; see ``interleave``).

Global rank 0 prints ``PAROBENCH <json>`` records (``meta``, ``run``, ``done``). A rank that fails prints
``PAROBENCH-ERROR [rank r] Type: message`` and exits non-zero; the driver records the variant as failed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import math
import os
import resource
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from _collective_worker import timed_section
from _testbed import ERROR_MARK, emit

import paro_torch

PARTIAL_KINDS = ("o_proj", "q_proj", "k_proj", "v_proj", "down_proj", "up_proj", "gate_proj")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


# ---------------------------------------------------------------------------------------------------- model
def build_model(cfg: dict[str, Any]) -> nn.Module:
    """The LlamaForCausalLM of the config's size, random weights from ``seed`` (identical on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = cfg["model"]
    config = LlamaConfig(
        vocab_size=mc["vocab"],
        hidden_size=mc["hidden"],
        intermediate_size=mc["intermediate"],
        num_hidden_layers=mc["layers"],
        num_attention_heads=mc["heads"],
        num_key_value_heads=mc["kv_heads"],
        max_position_embeddings=mc["seq"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(cfg["seed"])
    return LlamaForCausalLM(config)


def partial_subset(model: nn.Module, fraction: float) -> tuple[list[str], list[str]]:
    """The weight kinds (the same in every decoder layer) whose total is closest to ``fraction`` of all parameters.

    Tries every subset of PARTIAL_KINDS; ties go to fewer kinds, then to the order of PARTIAL_KINDS (attention
    output first). Returns (kinds, parameter names).
    """
    total = sum(p.numel() for p in model.parameters())
    per_kind = {k: 0 for k in PARTIAL_KINDS}
    names = {k: [] for k in PARTIAL_KINDS}
    for name, p in model.named_parameters():
        for k in PARTIAL_KINDS:
            if name.endswith(f".{k}.weight") and ".layers." in name:
                per_kind[k] += p.numel()
                names[k].append(name)
    target = total * fraction
    best: tuple[float, int, tuple[int, ...]] | None = None
    for r in range(1, len(PARTIAL_KINDS) + 1):
        for combo in itertools.combinations(range(len(PARTIAL_KINDS)), r):
            key = (abs(sum(per_kind[PARTIAL_KINDS[i]] for i in combo) - target), r, combo)
            if best is None or key < best:
                best = key
    assert best is not None
    kinds = [PARTIAL_KINDS[i] for i in best[2]]
    return kinds, [n for k in kinds for n in names[k]]


def apply_scenario(model: nn.Module, cfg: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """Makes the scenario's parameters trainable: ``full`` all, ``partial`` ~1/16, ``lora`` only the adapters."""
    scenario = cfg["scenario"]
    info: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
    if scenario == "partial":
        kinds, chosen = partial_subset(model, cfg["partial_fraction"])
        for name, p in model.named_parameters():
            p.requires_grad_(name in chosen)
        info["partial_kinds"] = kinds
    elif scenario == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(cfg["seed"] + 1)  # adapter init, identical on every rank and for every variant
        lora = LoraConfig(r=cfg["lora_r"], lora_alpha=2 * cfg["lora_r"], lora_dropout=0.0,
                          target_modules=LORA_TARGETS)  # fmt: skip
        model = get_peft_model(model, lora)
        info["lora"] = {"r": cfg["lora_r"], "alpha": 2 * cfg["lora_r"], "targets": LORA_TARGETS}
    elif scenario != "full":
        raise ValueError(f"unknown scenario {scenario!r}")
    info["params"] = sum(p.numel() for p in model.parameters())
    info["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, info


def decoder_layer_class() -> type[nn.Module]:
    """The wrapping unit of every system."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def unit_blocks(model: nn.Module, unit: type[nn.Module]) -> list[tuple[int, int]]:
    """(numel, trainable numel) of each unit as ParoShardedModule forms them: the wrapped blocks, then the root."""
    blocks: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, unit):
                blocks.append(child)
            else:
                visit(child)

    visit(model)
    inside = {id(p) for b in blocks for p in b.parameters()}
    rest = [p for p in model.parameters() if id(p) not in inside]
    out = [(sum(p.numel() for p in b.parameters()), sum(p.numel() for p in b.parameters() if p.requires_grad))
           for b in reversed(blocks)]  # fmt: skip
    out.append((sum(p.numel() for p in rest), sum(p.numel() for p in rest if p.requires_grad)))
    return out


# -------------------------------------------------------------------------------------------------- systems
class System:
    """A wrapped model and its optimizer: ``micro`` runs one micro-batch (forward + backward), ``step`` the update."""

    def __init__(self, cfg: dict[str, Any], model: nn.Module, nodes: int, per_node: int, links: Any = None) -> None:
        """``links``: a paro variant's figures (``LinkCalibration``) in place of its own model probe."""
        self.cfg, self.nodes, self.per_node, self.links = cfg, nodes, per_node, links
        self.accum, self.clip, self.lr = cfg["grad_accum"], cfg["clip"], cfg["lr"]
        self.extra: dict[str, Any] = {}
        self.phases: dict[str, float] = {}  # seconds per phase, summed since reset_counted
        self.optimizer: torch.optim.Optimizer | None = None
        system, _, option = cfg["variant"].partition(":")
        self.system, self.option = system, option
        self.model = getattr(self, f"_wrap_{system.replace('-', '_')}")(model, option)

    def _adamw(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in params if p.requires_grad], lr=self.lr)

    # --- wrapping
    def _wrap_paro(self, model: nn.Module, option: str) -> nn.Module:
        from paro_torch import ParoShardedModule
        from paro_torch.auto import default_memory_budget

        tokens = self.cfg["micro_batch"] * self.cfg["model"]["seq"]  # per rank and micro-step: the cost model's compute
        batch = torch.randint(0, self.cfg["model"]["vocab"], (self.cfg["micro_batch"], self.cfg["model"]["seq"]),
                              generator=torch.Generator().manual_seed(self.cfg["data_seed"] + 1))  # fmt: skip
        # example_inputs: the cost model's plan (every strategy's, for auto; this one's otherwise) with the compute
        # throughput of this model's own forward and backward, timed on every rank before sharding; or the figures
        # another variant's probe measured (interleave)
        probe: dict[str, Any] = (  # an explicit strategy is planned only with a budget or a probe
            {"calibration": self.links, "memory_budget": default_memory_budget(self.per_node)}
            if self.links is not None
            else {"example_inputs": {"input_ids": batch, "labels": batch}}
        )
        wrapped = ParoShardedModule(model, option, wrap_policy={decoder_layer_class()}, grad_accum=self.accum,
                                    clips_grad_norm=self.clip > 0, tokens_per_micro_step=tokens, **probe)  # fmt: skip
        self.optimizer = torch.optim.AdamW(wrapped.parameters(), lr=self.lr)
        assert wrapped.plan is not None and wrapped.links is not None
        self.links = wrapped.links
        mine = next(s for s in wrapped.plan["strategies"] if s["code"] == wrapped.strategy.code)
        self.extra["strategy"] = wrapped.strategy.code
        self.extra["links"] = wrapped.links.to_record()
        self.extra["predicted"] = {
            "time_s": mine["time_s"],
            "step": mine["step"],
            "intra_bytes_per_rank": mine["intra_bytes"],
            "inter_bytes_per_rank": mine["inter_bytes"],
            "memory_total_per_rank": mine["memory"]["total"],
            "memory": mine["memory"],
            "collectives": mine["collectives"],
        }
        if option == "auto":  # what it weighed
            self.extra["auto_choice"] = wrapped.plan["choice"]["code"] if wrapped.plan.get("choice") else None
            self.extra["auto_reason"] = wrapped.plan.get("reason")
            self.extra["plan"] = wrapped.plan
        return wrapped

    def _wrap_ddp(self, model: nn.Module, option: str) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        self.optimizer = self._adamw(wrapped.parameters())
        return wrapped

    def _wrap_fsdp1(self, model: nn.Module, option: str) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        kwargs: dict[str, Any] = {}
        if "HYBRID" in option:
            kwargs["device_mesh"] = init_device_mesh("cpu", (self.nodes, self.per_node),
                                                     mesh_dim_names=("replicate", "shard"))  # fmt: skip
        mixed = any(not p.requires_grad for p in model.parameters())
        wrapped = FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy[option],
            auto_wrap_policy=ModuleWrapPolicy({decoder_layer_class()}),
            device_id=torch.device("cpu"),
            use_orig_params=mixed,  # frozen and trainable parameters in one unit need it
            **kwargs,
        )
        self.extra["use_orig_params"] = mixed
        self.optimizer = self._adamw(wrapped.parameters())
        return wrapped

    def _wrap_fsdp2(self, model: nn.Module, option: str) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = self.nodes * self.per_node
        if option == "hsdp":
            mesh = init_device_mesh("cpu", (self.nodes, self.per_node), mesh_dim_names=("dp_replicate", "dp_shard"))
        elif option == "":
            mesh = init_device_mesh("cpu", (world,))
        else:
            raise ValueError(f"unknown fsdp2 option {option!r}")
        unit = decoder_layer_class()
        for m in list(model.modules()):
            if isinstance(m, unit):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.optimizer = self._adamw(model.parameters())
        return model

    def _wrap_deepspeed(self, model: nn.Module, option: str) -> nn.Module:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        stage3 = {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,  # re-gather in backward even on a small model
            "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": 0,
        }
        zero = {
            "zero2": {"stage": 2},
            "zero3": stage3,
            "hpz": {**stage3, "zero_hpz_partition_size": self.per_node},
            "mics": {**stage3, "mics_shard_size": self.per_node},
        }.get(option)
        if zero is None:
            raise ValueError(f"unknown deepspeed option {option!r}")
        config = {
            "train_micro_batch_size_per_gpu": self.cfg["micro_batch"],
            "gradient_accumulation_steps": self.accum,
            "gradient_clipping": self.clip,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": zero,
            "steps_per_print": 10**9,
        }
        self.extra["deepspeed_config"] = config
        opt = self._adamw(model.parameters())
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        return engine

    # --- training
    def micro(self, x: torch.Tensor, last: bool) -> float:
        """Forward and backward of one micro-batch; gradient sync only on the last one of a step."""
        if self.system == "deepspeed":
            with self._phase("forward"):
                loss = self.model(input_ids=x, labels=x).loss
            with self._phase("backward + DeepSpeed step"):
                self.model.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
                self.model.step()  # applies the update at the accumulation boundary only
            return float(loss.detach())
        if self.system == "fsdp2":
            self.model.set_requires_gradient_sync(last)
            ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        else:
            ctx = contextlib.nullcontext() if last else self.model.no_sync()
        with ctx:
            with self._phase("forward"):
                loss = self.model(input_ids=x, labels=x).loss
            with self._phase("backward (sync)" if last else "backward (no sync)"):
                (loss / self.accum).backward()
        return float(loss.detach())

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def step(self) -> None:
        """Clip to the global norm and update (DeepSpeed did both in its last ``micro``)."""
        if self.system == "deepspeed":
            return
        assert self.optimizer is not None
        with self._phase("clip + optimizer"):
            if self.system in ("paro", "fsdp1"):
                self.model.clip_grad_norm_(self.clip)
            else:
                torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, batches: torch.Tensor) -> float:
        """One optimizer step over ``batches`` (grad_accum x micro_batch x seq); returns the mean micro-batch loss."""
        losses = [self.micro(batches[i], i == self.accum - 1) for i in range(self.accum)]
        self.step()
        return sum(losses) / len(losses)

    # --- accounting
    def reset_counted(self) -> None:
        self.phases.clear()
        if self.system == "paro":
            self.model.reset_comm_bytes()

    def counted(self) -> dict[str, int] | None:
        """Bytes this rank sent in the engine's collectives since ``reset_counted``, by level.

        Nominal (``ParoShardedModule.comm_bytes``: the ring formula per collective, which a test checks equals what
        the ``paro`` backend measures); the engine's groups are plain Gloo groups.
        """
        if self.system != "paro":
            return None
        sent = self.model.comm_bytes()
        return {"intra_bytes": sent["intra"], "inter_bytes": sent["inter"], "flat_bytes": 0}

    def comm_seconds(self) -> dict[str, float] | None:
        """Seconds the engine's communication threads spent in each "<collective> <level>" since ``reset_counted``."""
        if self.system != "paro":
            return None
        return self.model.comm_seconds()

    def memory_stats(self) -> dict[str, int] | None:
        if self.system == "paro":
            return self.model.memory_stats(self.optimizer)
        return None


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


class HeapSampler:
    """Peak of glibc's live heap bytes (mallinfo2: in-use arena bytes + mmapped chunks), sampled by a thread.

    Unlike RSS it does not count what the allocator keeps after a free (glibc raises its mmap threshold after
    freeing a large block, so later transient buffers stay in the heap and RSS never shrinks back), nor code pages.
    Peaks shorter than the sampling interval can be missed. ``available`` is False off glibc (no mallinfo2).
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        try:
            libc = ctypes.CDLL("libc.so.6")
            self._fn = libc.mallinfo2
            self._fn.restype = _Mallinfo2
            self.available = True
        except (OSError, AttributeError):
            self.available = False
        self.start_bytes = self.peak_bytes = self.live() if self.available else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heap-sampler")

    def live(self) -> int:
        info = self._fn()
        return int(info.uordblks + info.hblkhd)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self.live())

    def start(self) -> HeapSampler:
        if self.available:
            self._thread.start()
        return self

    def stop(self) -> dict[str, int] | None:
        """{"start": live bytes at start, "peak": the largest sample} (None without mallinfo2)."""
        if not self.available:
            return None
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self.live())
        return {"start": self.start_bytes, "peak": self.peak_bytes}


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (getrusage's ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------------------------ main
def calibrate(cfg: dict[str, Any]) -> None:
    """Measures the links of this layout and writes them where every paro run will read them."""
    links = paro_torch.calibrate(cfg["calibration_path"], group_size=cfg["per_node"])
    if dist.get_rank() == 0:
        emit("calibration", path=cfg["calibration_path"], links=links.to_record())


class _Rank:
    """What a measuring rank needs besides the model: its node, a Gloo group for barriers and gathering results
    (off the measured groups) and the interfaces whose byte counters it reads (local rank 0 only)."""

    def __init__(self) -> None:
        self.node = int(os.environ.get("GROUP_RANK", "0"))
        self.bar = dist.new_group(backend="gloo")
        iface = os.environ.get("GLOO_SOCKET_IFNAME") or "lo"
        self.counter_ifaces = sorted({iface, "lo"}) if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None

    def gathered(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        objs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(objs, obj, group=self.bar)
        return objs


def train(cfg: dict[str, Any]) -> None:
    """Builds, wraps, warms up and measures one variant; rank 0 emits a ``run`` record."""
    rank, world = dist.get_rank(), dist.get_world_size()
    me = _Rank()
    node, bar, counter_ifaces, gathered = me.node, me.bar, me.counter_ifaces, me.gathered

    heap = HeapSampler().start()  # before the model exists: the peak minus this is what training added
    t0 = time.perf_counter()
    model, info = apply_scenario(build_model(cfg), cfg)
    system = System(cfg, model, cfg["nodes"], cfg["per_node"])
    setup_s = time.perf_counter() - t0
    if rank == 0:
        emit("meta", variant=cfg["variant"], scenario=cfg["scenario"], world=world, model=info, setup_s=setup_s)

    steps, warmup = cfg["steps"], cfg["warmup"]
    data = _rank_batches(cfg, rank, world)

    losses: list[float] = []
    warm_times = []
    for i in range(warmup):
        dist.barrier(group=bar)
        start = time.perf_counter()
        losses.append(system.train_step(data[i]))
        warm_times.append(time.perf_counter() - start)
    rss_before = rss_bytes()

    # what the barriers of the measured section add to the counters, measured with no step at all
    _, overhead, _ = timed_section(None, lambda: None, steps, bar, counter_ifaces, False)
    counter = iter(range(warmup, warmup + steps))
    system.reset_counted()
    times_ms, delta, _ = timed_section(
        lambda: losses.append(system.train_step(data[next(counter)])), lambda: None, steps, bar, counter_ifaces, False
    )
    counted = system.counted()
    comm_seconds = system.comm_seconds()
    heap_stats = heap.stop()
    mine = {
        "rank": rank,
        "node": node,
        "times_ms": times_ms,
        "warmup_ms": [t * 1e3 for t in warm_times],
        "losses": losses,
        "delta": delta,
        "overhead": overhead,
        "counted": counted,
        "comm_seconds": {k: v / steps for k, v in comm_seconds.items()} if comm_seconds is not None else None,
        "rss_before_train": rss_before,
        "peak_rss": peak_rss_bytes(),
        "heap": heap_stats,
        "memory_stats": system.memory_stats(),
        "phases_ms": {k: v * 1e3 / steps for k, v in system.phases.items()},
    }
    rows = gathered(mine)
    if rank == 0:
        _emit_run(system, rows, info, steps, warmup, setup_s)


def _rank_batches(cfg: dict[str, Any], rank: int, world: int) -> torch.Tensor:
    """This rank's slice of every global batch, (warmup + steps, grad_accum, micro_batch, seq): the same for all."""
    steps, mb = cfg["warmup"] + cfg["steps"], cfg["micro_batch"]
    gen = torch.Generator().manual_seed(cfg["data_seed"])
    data = torch.randint(0, cfg["model"]["vocab"], (steps, cfg["grad_accum"], world * mb, cfg["model"]["seq"]),
                         generator=gen)  # fmt: skip
    return data[:, :, rank * mb : (rank + 1) * mb].contiguous()


def _emit_run(
    system: System,
    rows: list[dict[str, Any]],
    info: dict[str, Any],
    steps: int,
    warmup: int,
    setup_s: float,
    interleaved: bool = False,
) -> None:
    """Rank 0's ``run`` record from every rank's figures (``rows``); memory figures where the rows have them."""
    world = len(rows)
    per_step_max = [max(r["times_ms"][i] for r in rows) for i in range(steps)]
    step_losses = [sum(r["losses"][i] for r in rows) / world for i in range(warmup + steps)]
    memory = {
        f"{key}_per_rank": [r[key] for r in rows] for key in ("peak_rss", "rss_before_train", "heap") if key in rows[0]
    }
    emit(
        "run",
        variant=system.cfg["variant"],
        scenario=system.cfg["scenario"],
        world=world,
        model=info,
        steps=steps,
        warmup=warmup,
        interleaved=interleaved,
        step_ms=per_step_max,
        step_ms_median=statistics.median(per_step_max),
        warmup_ms=[max(r["warmup_ms"][i] for r in rows) for i in range(warmup)],
        times_ms_per_rank=[r["times_ms"] for r in rows],
        phases_ms_per_rank=[r["phases_ms"] for r in rows],  # per step, mean over the measured steps
        losses=step_losses,
        loss=step_losses[-1],
        nodes=[{"node": r["node"], "delta": r["delta"], "overhead": r["overhead"]} for r in rows if r["delta"]],
        counted=[r["counted"] for r in rows] if rows[0]["counted"] is not None else None,
        comm_seconds_per_rank=[r["comm_seconds"] for r in rows] if rows[0]["comm_seconds"] is not None else None,
        **memory,
        memory_stats_per_rank=[r["memory_stats"] for r in rows] if rows[0]["memory_stats"] else None,
        setup_s=setup_s,
        extra=system.extra,
    )
    if not all(math.isfinite(x) for x in step_losses):
        print(f"warning: non-finite loss {step_losses}", file=sys.stderr)


def interleave(cfg: dict[str, Any]) -> None:
    """Every variant of ``cfg["variants"]`` (paro only) in this launch, their measured steps taken in turns.

    Each variant gets its own model (the same seed) and optimizer. Then ``warmup`` rounds, and ``steps`` measured
    rounds, each run one step of every variant (each bracketed by barriers and, on local rank 0, the link counters),
    a round starting one variant later than the one before: a slow spell of the machine falls on all variants
    alike, where one launch per variant puts each in its own spell (on 2 shared cores the same variant measured up
    to 20 % apart between launches). The first variant probes the model (put ``paro:auto`` first: its plan weighs
    every strategy) and the others are planned with its figures, so every prediction of the launch comes from one
    probe. Rank 0 emits a ``run`` record per variant, as ``train`` does, without the process-wide memory figures.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    me = _Rank()
    node, bar, counter_ifaces = me.node, me.bar, me.counter_ifaces
    systems: list[tuple[System, dict[str, Any], float]] = []
    links = None
    for variant in cfg["variants"]:
        if not variant.startswith("paro:"):
            raise ValueError(f"interleave runs paro variants only, not {variant!r}")
        vcfg = {**cfg, "variant": variant}
        t0 = time.perf_counter()
        model, info = apply_scenario(build_model(vcfg), vcfg)
        system = System(vcfg, model, cfg["nodes"], cfg["per_node"], links=links)
        links = system.links
        systems.append((system, info, time.perf_counter() - t0))
    steps, warmup = cfg["steps"], cfg["warmup"]
    data = _rank_batches(cfg, rank, world)
    losses: list[list[float]] = [[] for _ in systems]
    warm_ms: list[list[float]] = [[] for _ in systems]
    n = len(systems)
    for i in range(warmup):  # in turns too: warmed up alone, full NNN's first measured step ran 1.7x its later ones
        for j in range(n):
            k = (i + j) % n
            dist.barrier(group=bar)
            start = time.perf_counter()
            losses[k].append(systems[k][0].train_step(data[i]))
            warm_ms[k].append((time.perf_counter() - start) * 1e3)
    # what one visit's barriers and counter reads add to the counters, measured with no step at all
    overhead = _sum_deltas([timed_section(None, lambda: None, 1, bar, counter_ifaces, False)[1] for _ in range(steps)])
    times: list[list[float]] = [[] for _ in systems]
    deltas: list[list[Any]] = [[] for _ in systems]
    totals: list[dict[str, dict[str, float]]] = [{"counted": {}, "comm": {}, "phases": {}} for _ in systems]
    for r in range(steps):
        for j in range(n):
            k = (r + j) % n
            system = systems[k][0]
            system.reset_counted()

            def one_step(k: int = k, system: System = system, batches: torch.Tensor = data[warmup + r]) -> None:
                losses[k].append(system.train_step(batches))

            ms, delta, _ = timed_section(one_step, lambda: None, 1, bar, counter_ifaces, False)
            times[k] += ms
            deltas[k].append(delta)
            for key, got in (("counted", system.counted()), ("comm", system.comm_seconds()), ("phases", system.phases)):
                for name, x in (got or {}).items():
                    totals[k][key][name] = totals[k][key].get(name, 0) + x
    for k, (system, info, setup_s) in enumerate(systems):
        mine = {
            "rank": rank,
            "node": node,
            "times_ms": times[k],
            "warmup_ms": warm_ms[k],
            "losses": losses[k],
            "delta": _sum_deltas(deltas[k]),
            "overhead": overhead,
            "counted": {name: int(x) for name, x in totals[k]["counted"].items()},
            "comm_seconds": {name: x / steps for name, x in totals[k]["comm"].items()},
            "memory_stats": system.memory_stats(),
            "phases_ms": {name: x * 1e3 / steps for name, x in totals[k]["phases"].items()},
        }
        objs = me.gathered(mine)
        if rank == 0:
            _emit_run(system, objs, info, steps, warmup, setup_s, interleaved=True)


def _sum_deltas(deltas: list[dict[str, dict[str, int]] | None]) -> dict[str, dict[str, int]] | None:
    """The sum of link-counter deltas (interface -> rx/tx bytes); None where this rank reads no counters."""
    if not deltas or deltas[0] is None:
        return None
    return {i: {k: sum(d[i][k] for d in deltas if d) for k in ("rx", "tx")} for i in deltas[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-config", required=True, help="JSON file written by training.py")
    cfg = json.loads(open(ap.parse_args().bench_config).read())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.get("timeout_s", 300)))
    {"calibrate": calibrate, "train": train, "interleave": interleave}[cfg["mode"]](cfg)
    dist.barrier()
    if dist.get_rank() == 0:
        emit("done", variant=cfg.get("variant"))
    dist.destroy_process_group()


@contextlib.contextmanager
def _report_errors() -> Iterator[None]:
    try:
        yield
    except Exception as e:  # make the failing rank and its reason obvious to the driver
        msg = " ".join(str(e).split())[:600]
        print(f"{ERROR_MARK}[rank {os.environ.get('RANK', '?')}] {type(e).__name__}: {msg}", file=sys.stderr,
              flush=True)  # fmt: skip
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not hang in atexit handlers or process-group teardown


if __name__ == "__main__":
    with _report_errors():
        main()
