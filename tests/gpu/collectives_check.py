"""Backend-independent checks on one rank (``--backend gloo|nccl|paro --device cuda|cpu``).

- every collective (all_reduce sum/avg/max, all_gather_into_tensor, reduce_scatter_tensor, broadcast, all_gather
  into a list, all_to_all_single) on float32 and bfloat16 tensors, against a reference each rank computes on the CPU
  from every rank's inputs (small integers: every result is exact, so the comparison is bit for bit);
- CUDA only, a stream race detector: on a side stream the GPU sleeps, then writes the input, then the collective is
  issued (async_op=True) from that stream's context; after ``work.wait()`` the result is read at once on the current
  stream. A backend that does not order its collective after the side stream, or ``wait()`` that does not order the
  current stream after the collective, reads stale data;
- a Future check: ``work.get_future().then(...)`` reads the result without ``torch.cuda.synchronize()``;
- a DDP communication hook that uses only the Future (all_reduce(async_op=True).get_future().then(...)), 3 steps
  of a tiny model, against single-process training on the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _common import Checks, assert_equal, init, parse_args

SIZES = [1, 4099, 2_500_003]  # the last is ~10 MB in float32: paro splits it into several chunks
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time at 2 GHz


def values(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integers in [-2, 2]: sums, maxima and averages over 4 ranks are exact in bf16."""
    i = torch.arange(numel, dtype=torch.int64)
    return ((rank * 7 + i * 3 + salt) % 5 - 2).to(dtype)


def main() -> None:
    args = parse_args()
    rank, world, dev = init(args.backend, args.device)
    checks = Checks(rank)
    cuda = dev.type == "cuda"
    print(f"rank {rank}/{world}: backend {args.backend} on {dev}", flush=True)

    def on_dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev, copy=True)  # a fresh tensor also on the CPU: the references stay intact

    for dname, dtype in DTYPES.items():
        for n in SIZES:
            tag = f"{dname} n={n}"
            ins = [values(r, n, dtype) for r in range(world)]
            wide = torch.stack([t.double() for t in ins])

            def all_reduce(op: str, ins=ins, wide=wide, dtype=dtype) -> str | None:
                if op == "avg" and args.backend == "gloo":
                    return "skipped: Gloo has no ReduceOp.AVG"
                x = on_dev(ins[rank])
                rop = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}[op]
                dist.all_reduce(x, op=rop)
                want = {"sum": wide.sum(0), "avg": wide.sum(0) / world, "max": wide.max(0).values}[op]
                assert_equal(f"all_reduce {op}", x, want.to(dtype))
                return None

            for op in ("sum", "avg", "max"):
                checks.run(f"all_reduce {op} {tag}", lambda op=op: all_reduce(op))

            def all_gather_into_tensor(ins=ins, n=n, dtype=dtype) -> None:
                out = torch.full((world * n,), 99, dtype=dtype, device=dev)
                dist.all_gather_into_tensor(out, on_dev(ins[rank]))
                assert_equal("all_gather_into_tensor", out, torch.cat(ins))

            checks.run(f"all_gather_into_tensor {tag}", all_gather_into_tensor)

            def reduce_scatter_tensor(n=n, dtype=dtype) -> None:
                big = [values(r, world * n, dtype, salt=1) for r in range(world)]
                out = torch.full((n,), 99, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(out, on_dev(big[rank]))
                want = torch.stack([b.double() for b in big]).sum(0)[rank * n : (rank + 1) * n]
                assert_equal("reduce_scatter_tensor", out, want.to(dtype))

            checks.run(f"reduce_scatter_tensor {tag}", reduce_scatter_tensor)

            def broadcast(ins=ins) -> None:
                root = 1 % world
                x = on_dev(ins[rank])
                dist.broadcast(x, src=root)
                assert_equal("broadcast", x, ins[root])

            checks.run(f"broadcast {tag}", broadcast)

            def all_gather_list(ins=ins, n=n, dtype=dtype) -> None:
                outs = [torch.full((n,), 99, dtype=dtype, device=dev) for _ in range(world)]
                dist.all_gather(outs, on_dev(ins[rank]))
                for r in range(world):
                    assert_equal(f"all_gather[{r}]", outs[r], ins[r])

            checks.run(f"all_gather list {tag}", all_gather_list)

            def all_to_all_single(n=n, dtype=dtype) -> None:
                big = [values(r, world * n, dtype, salt=2) for r in range(world)]
                out = torch.full((world * n,), 99, dtype=dtype, device=dev)
                dist.all_to_all_single(out, on_dev(big[rank]))
                want = torch.cat([big[r][rank * n : (rank + 1) * n] for r in range(world)])
                assert_equal("all_to_all_single", out, want)

            checks.run(f"all_to_all_single {tag}", all_to_all_single)

    n = SIZES[-1]
    ins = [values(r, n, torch.float32, salt=3) for r in range(world)]
    total = torch.stack(ins).sum(0)

    def race(collective: str) -> str | None:
        if not cuda:
            return "skipped: no GPU (streams)"
        src = on_dev(ins[rank])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        x = torch.full((n,), 1000.0, device=dev)
        out = x if collective == "all_reduce" else torch.full((world * n,), 1000.0, device=dev)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            x.copy_(src)  # written only after the sleep
            if collective == "all_reduce":
                work = dist.all_reduce(x, async_op=True)
            else:
                work = dist.all_gather_into_tensor(out, x, async_op=True)
        work.wait()
        got = out.clone()  # at once, on the current stream
        want = total if collective == "all_reduce" else torch.cat(ins)
        assert_equal(f"{collective} after a side-stream write", got, want)
        torch.cuda.synchronize()
        return None

    checks.run("stream race, all_reduce issued on a sleeping side stream", lambda: race("all_reduce"))
    checks.run("stream race, all_gather_into_tensor issued on a sleeping side stream", lambda: race("all_gather"))

    def future_then() -> None:
        x = torch.full((n,), 1000.0, device=dev)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)  # the input is written late on the current stream
        x.copy_(on_dev(ins[rank]))
        work = dist.all_reduce(x, async_op=True)
        fut = work.get_future().then(lambda f: f.value()[0] * 2)
        got = fut.wait()  # no synchronize: the Future orders the reading stream
        assert_equal("get_future().then(...)", got, total * 2)

    checks.run("future, get_future().then() without synchronize", future_then)

    def ddp_future_hook() -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        def make() -> torch.nn.Module:
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

        def batch(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(1000 * step + r)
            return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)

        def hook(state, bucket):  # unannotated: DDP checks real annotations, and this file has string ones
            t = bucket.buffer().div_(world)
            return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

        model = DDP(make().to(dev), device_ids=[0] if cuda else None)
        model.register_comm_hook(None, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref = make()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev)).backward()
            opt.step()
            ref_opt.zero_grad()  # the same step on one process: the mean of every rank's mean loss
            losses = [torch.nn.functional.mse_loss(ref(bx), by) for bx, by in (batch(r, step) for r in range(world))]
            (sum(losses) / world).backward()
            ref_opt.step()
        for (name, p), q in zip(model.module.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(
                p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )

    checks.run("ddp, Future-only allreduce comm hook, 3 steps = one process", ddp_future_hook)
    checks.finish()


if __name__ == "__main__":
    main()
