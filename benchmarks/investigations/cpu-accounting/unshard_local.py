"""The local memory work of one p = I / G unshard on CPU, without the collective (one process, one thread).

    python3 benchmarks/investigations/cpu-accounting/unshard_local.py

What ``FlatBuffer._unshard`` and ``reshard`` do besides the all-gather, for the training benchmark's model (9.6 M
float32 parameters, 38 MB): a fresh ``whole`` buffer (the gather's output: its first touch is timed here as a copy),
the parameters' storage allocated again, the blocked-to-natural copy (``from_blocks``), the storage freed; against a
plain copy of the same bytes into memory already touched.
"""

import time

import torch

N = 9_600_000


def main() -> None:
    torch.set_num_threads(1)
    src, full, warm = torch.randn(N), torch.empty(N), torch.empty(N)

    def unshard_local() -> None:
        whole = torch.empty(N)
        whole.copy_(src)  # stands for the gather writing its output
        full.untyped_storage().resize_(N * 4)
        full.copy_(whole)  # from_blocks
        full.untyped_storage().resize_(0)  # reshard

    def copy_only() -> None:
        warm.copy_(src)

    for f in (unshard_local, copy_only):
        f()
        start = time.perf_counter()
        for _ in range(10):
            f()
        print(f"{f.__name__}: {(time.perf_counter() - start) / 10 * 1e3:.1f} ms per {N * 4 / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
