"""One rank of a launch that runs several workers one after another in this process (tests/launch.py, ``Shared``).

Usage: cases.py SPEC; SPEC is JSON: {"cases": [[name, script, args, env, limit_s], ...], "hard_exit": bool}.

Importing torch and paro_torch and meeting the other ranks take most of a short worker's run on 2 cores; here they
happen once for all the cases. Each case runs as its worker would alone: the environment updated by the case's
``env`` (restored after it; TORCH_DISTRIBUTED_DEBUG read again), ``sys.argv = [script, *args]``, then the worker's
``main()`` (a worker without one cannot run here), then torch's default device unset again. Its default process
group is a new one: ``init_process_group`` gets this launch's one TCPStore (rank 0's, on MASTER_PORT) under a prefix
of the case's, so that no group meets the keys of the one before it. Its output is framed by the lines
``@@case NAME begins`` and ``@@case NAME exited CODE``.

After a case, every rank records its exit code in the store and waits for the others'. The launch stops at the first
case that failed on any rank (a peer of the failed rank may have been left in a collective): every rank exits 1, or
the failed rank's code. A case that runs past its ``limit_s`` prints every thread's stack and exits 1.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

WORKERS = Path(__file__).resolve().parent
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def run_worker(script: str, args: list[str]) -> int:
    """Runs one worker in this process; its exit code (0 when it returned)."""
    path = WORKERS / script
    sys.argv = [str(path), *args]
    try:
        importlib.import_module(path.stem).main()  # the workers' folder is sys.path[0] (this script's)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr, flush=True)
        return 1
    except BaseException:  # noqa: BLE001  (reported as the case's failure, as the interpreter would)
        traceback.print_exc()
        return 1
    return 0


def on_store(init_process_group: Callable[..., None], store: dist.Store) -> Callable[..., None]:
    """``init_process_group`` on ``store`` (the workers rendezvous through env://, which would bind MASTER_PORT),
    under a prefix of each call's (a worker may destroy its group and make another)."""
    calls = itertools.count()

    def init(backend: str | None = None, **kwargs: object) -> None:
        prefix = dist.PrefixStore(f"init{next(calls)}/", store)
        kwargs.update(store=kwargs.get("store") or prefix, rank=RANK, world_size=WORLD)
        init_process_group(backend, **kwargs)

    return init


def main() -> None:
    spec = json.loads(sys.argv[1])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), WORLD, RANK == 0,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    init_process_group = dist.init_process_group
    for index, (name, script, args, env, limit_s) in enumerate(spec["cases"]):
        prefix = dist.PrefixStore(f"case{index}/", store)
        before = dict(os.environ)
        os.environ.update(env)
        dist.set_debug_level_from_env()
        dist.init_process_group = on_store(init_process_group, prefix)
        start = time.monotonic()
        print(f"@@case {name} begins", flush=True)
        faulthandler.dump_traceback_later(limit_s, exit=True)
        code = run_worker(script, args)
        faulthandler.cancel_dump_traceback_later()
        if dist.is_initialized():  # a worker that failed before destroying its group
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (the case failed already)
                traceback.print_exc()
        dist.init_process_group = init_process_group
        torch.set_default_device(None)  # as a new process has it (workers/_device.py sets it)
        os.environ.clear()
        os.environ.update(before)
        dist.set_debug_level_from_env()
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"@@case {name} exited {code} after {time.monotonic() - start:.1f}s", flush=True)
        prefix.set(f"code/{RANK}", str(code))
        keys = [f"code/{r}" for r in range(WORLD)]
        try:
            prefix.wait(keys, datetime.timedelta(seconds=limit_s))
        except Exception as e:  # noqa: BLE001
            print(f"@@stopped: not every rank finished case {name} within {limit_s}s: {e}", flush=True)
            os._exit(1)
        codes = [int(prefix.get(k)) for k in keys]
        if any(codes):
            failed = [r for r, c in enumerate(codes) if c]
            print(f"@@stopped: case {name} failed on ranks {failed}", flush=True)
            sys.stdout.flush()
            os._exit(code or 1)
    store.set(f"done/{RANK}", "1")  # rank 0's store serves until every rank is done with it
    store.wait([f"done/{r}" for r in range(WORLD)])
    del store
    if spec.get("hard_exit"):  # skip the interpreter's teardown, as checkpoint.py does alone (its reason there)
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
