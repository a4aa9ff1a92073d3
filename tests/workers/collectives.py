"""Every collective of the ``paro`` backend against a reference computed from Gloo-gathered inputs.

Values are small integers, so every dtype (bf16 included) must match bit for bit. PARO_TEST_DEVICE=cuda runs
it on CUDA tensors (see _device.py).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from _device import test_device
from stats import check_counted_bytes

import paro_torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8]
SIZES = [0, 1, 7, 130, 1027]
# above 4 ranks (slow on 2 cores) one dtype per element size: what differs by dtype (reduction kernels, casts) runs
# alike at every world size and is checked on 4 ranks; the plans' chunk and shard boundaries depend on the size only
WIDE_DTYPES = [torch.float32, torch.bfloat16, torch.uint8]
Op = dist.ReduceOp


def values(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    i = torch.arange(numel)
    v = (rank * 7 + i * 3 + salt) % 5 - 2
    if dtype == torch.uint8:
        v = v + 2
    return v.to(dtype)


def reduce_ref(stack: torch.Tensor, op: str, world: int, dtype: torch.dtype) -> torch.Tensor:
    s = stack.to(torch.float64) if dtype.is_floating_point else stack.to(torch.int64)
    if op in ("sum", "avg", "premul"):
        r = s.sum(0)
    elif op == "product":
        r = s.prod(0)
    elif op == "min":
        r = s.min(0).values
    else:
        r = s.max(0).values
    if op == "avg":
        r = r / world
    if op == "premul":
        r = r * 0.5
    return r.to(dtype)


def torch_op(op: str):
    return {
        "sum": Op.SUM,
        "avg": Op.AVG,
        "product": Op.PRODUCT,
        "min": Op.MIN,
        "max": Op.MAX,
        "premul": dist._make_nccl_premul_sum(0.5),
    }[op]


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        diff = (got.double() - want.double()).abs().max().item() if got.numel() and got.shape == want.shape else "-"
        raise AssertionError(f"{name}: mismatch (max |diff| {diff}) got {got[:8]} want {want[:8]}")


def main() -> None:
    device = test_device()
    dist.init_process_group("paro")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    assert dist.get_backend() == "paro", dist.get_backend()

    def gathered(x: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x, group=gloo)
        return torch.stack(out)

    count = 0
    for dtype in DTYPES if world <= 4 else WIDE_DTYPES:
        ops = ["sum", "product", "min", "max"] + (["avg", "premul"] if dtype.is_floating_point else [])
        for numel in SIZES:
            tag = f"{dtype} n={numel}"
            x = values(rank, numel, dtype)
            stack = gathered(x)
            for op in ops:
                y = x.clone()
                dist.all_reduce(y, op=torch_op(op))
                check(f"all_reduce {op} {tag}", y, reduce_ref(stack, op, world, dtype))
                count += 1
            if dtype in (torch.float32, torch.int64):  # Gloo's own all_reduce agrees too
                y = x.clone()
                dist.all_reduce(y, group=gloo)
                z = x.clone()
                dist.all_reduce(z)
                check(f"all_reduce vs gloo {tag}", z, y)
            # all-gather: into a flat tensor, a stacked [world, n] tensor, in place, and the list form
            check(f"all_gather_into_tensor {tag}", _ag_flat(x, world), stack.reshape(-1))
            out = torch.empty(world, numel, dtype=dtype)
            dist.all_gather_into_tensor(out, x)
            check(f"all_gather_into_tensor stacked {tag}", out, stack)
            buf = torch.zeros(world * numel, dtype=dtype)
            buf[rank * numel : (rank + 1) * numel] = x
            dist.all_gather_into_tensor(buf, buf[rank * numel : (rank + 1) * numel])
            check(f"all_gather_into_tensor in place {tag}", buf, stack.reshape(-1))
            lst = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(lst, x)
            check(f"all_gather list {tag}", torch.stack(lst), stack)
            # reduce-scatter: rank i gets block i of the reduction of everyone's input
            big = values(rank, numel * world, dtype, salt=1)
            big_stack = gathered(big)
            for op in ops:
                out = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_tensor(out, big.clone(), op=torch_op(op))
                want = reduce_ref(big_stack, op, world, dtype)[rank * numel : (rank + 1) * numel]
                check(f"reduce_scatter_tensor {op} {tag}", out, want)
            out = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter(out, list(big.clone().chunk(world)) if numel else [big[:0]] * world)
            want = reduce_ref(big_stack, "sum", world, dtype)[rank * numel : (rank + 1) * numel]
            check(f"reduce_scatter list {tag}", out, want)
            for root in range(world):
                y = x.clone()
                dist.broadcast(y, src=root)
                check(f"broadcast root={root} {tag}", y, stack[root])
                y = x.clone()
                dist.reduce(y, dst=root, op=Op.SUM)
                if rank == root:
                    check(f"reduce root={root} {tag}", y, reduce_ref(stack, "sum", world, dtype))
            count += 1
    # coalesced forms, as FSDP2 issues them
    xs = [values(rank, n, torch.float32) for n in (3, 5)]
    outs = [torch.empty(world * x.numel()) for x in xs]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, x in zip(outs, xs, strict=True):
            dist.all_gather_into_tensor(o, x)
    cm.wait()
    for o, x in zip(outs, xs, strict=True):
        check("coalesced all_gather", o, gathered(x).reshape(-1))
    # the list-of-lists form: output_lists[r][i] is input i of rank r (as Gloo returns it)
    lists = [[torch.empty_like(x) for x in xs] for _ in range(world)]
    dist.all_gather_coalesced(lists, xs)
    for i, x in enumerate(xs):
        check("all_gather_coalesced", torch.stack([lists[r][i] for r in range(world)]), gathered(x))
    dist.barrier()
    # pass-through collectives
    a2a_in = torch.arange(world, dtype=torch.float32) + rank * 100
    a2a_out = torch.empty(world)
    dist.all_to_all_single(a2a_out, a2a_in)
    check("all_to_all_single", a2a_out, torch.arange(world, dtype=torch.float32) * 100 + rank)
    if device.type == "cpu" or os.environ.get("PARO_DEVICE_SUB_BACKEND") != "gloo":  # Gloo: no CUDA send/recv
        if rank == 0:
            dist.send(torch.tensor([42.0]), dst=world - 1)
        if rank == world - 1:
            t = torch.zeros(1)
            dist.recv(t, src=0)
            check("send/recv", t, torch.tensor([42.0]))
    if device.type == "cpu":
        # sparse all_reduce (Gloo's, in order with the rest), as on Gloo
        idx = torch.tensor([[rank, world]])
        sparse = torch.sparse_coo_tensor(idx, torch.tensor([rank + 1.0, 1.0]), (world + 1,), check_invariants=True)
        dist.all_reduce(sparse)
        want = torch.cat([torch.arange(1.0, world + 1), torch.tensor([float(world)])])
        check("sparse all_reduce", sparse.to_dense(), want)
        check_sub_backends_borrow(rank, world)
        if 1 < paro_torch._backend.resolve_group_size(world) < world:  # two levels: bytes per level
            check_counted_bytes(gloo)
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.14":  # before, only Gloo groups may call it
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    # bad input gets a clear error, on every rank, before anything is sent
    bad = [(torch.empty(3), torch.empty(2), "needs an output of")]
    if device.type != "cpu":
        bad.append((torch.empty(2 * world, device="cpu"), torch.empty(2), "on different devices"))
    for out, inp, message in bad:
        try:
            dist.all_gather_into_tensor(out, inp)
        except Exception as e:  # noqa: BLE001
            assert message in str(e), e
        else:
            raise AssertionError(f"accepted: an output of {out.shape} on {out.device}, an input on {inp.device}")
    dist.barrier()
    print(f"rank {rank}: {count} checks OK, stats {paro_torch.comm_stats()}")
    dist.destroy_process_group()


def storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def check_sub_backends_borrow(rank: int, world: int) -> None:
    """While a collective is in flight, the sub-backends hold no reference to the caller's tensors.

    Gloo releases a finished collective's tensors on its own thread after wait() returns; a tensor owned by a
    Python object and released there while the interpreter exits aborts the process (clean exits). Rank 0 starts
    each collective and looks at its tensors' storage while the other ranks are still asleep.
    """
    calls = {  # name: (output numel, call(input, output))
        "all_reduce": (0, lambda a, b: dist.all_reduce(a, async_op=True)),
        "all_gather_into_tensor": (world * world, lambda a, b: dist.all_gather_into_tensor(b, a, async_op=True)),
        "all_to_all_single": (world, lambda a, b: dist.all_to_all_single(b, a, async_op=True)),
    }
    for name, (out_numel, call) in calls.items():
        a, b = torch.ones(world), torch.zeros(out_numel)
        before = (storage_refs(a), storage_refs(b))
        if rank != 0:
            time.sleep(0.4)
        work = call(a, b)
        if rank == 0:
            time.sleep(0.2)
            during = (storage_refs(a), storage_refs(b))
            assert during == before, f"{name}: a sub-backend holds the caller's tensors ({before} -> {during})"
        work.wait()


def _ag_flat(x: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty(world * x.numel(), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x)
    return out


if __name__ == "__main__":
    sys.exit(main())
