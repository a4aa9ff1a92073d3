"""Bytes per level that the ``paro`` backend counts match the ring formulas; sub-groups built by new_group.

Usage: stats.py (a Gloo world); collectives.py runs the same checks in a paro world.
"""

import logging

import torch
import torch.distributed as dist

import paro_torch


def check_counted_bytes(not_paro: dist.ProcessGroup) -> None:
    """On new paro groups over every rank and over all but the last; ``not_paro``: a group of another backend."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = paro_torch._backend.resolve_group_size(world)
    g = world // m
    pg = dist.new_group(backend="paro")
    n_elem = 6 * world  # per-rank block
    e = 4
    # all-gather of S = world * n_elem * e bytes: (g-1)/g*S/m inter, (m-1)/m*S intra
    s = world * n_elem * e
    paro_torch.reset_comm_stats(pg)
    out = torch.empty(world * n_elem)
    dist.all_gather_into_tensor(out, torch.full((n_elem,), float(rank)), group=pg)
    st = paro_torch.comm_stats(pg)
    assert st.inter_bytes * g * m == (g - 1) * s and st.intra_bytes * m == (m - 1) * s, st
    assert torch.equal(out, torch.arange(world).float().repeat_interleave(n_elem))
    # reduce-scatter: the same volumes
    paro_torch.reset_comm_stats(pg)
    red = torch.empty(n_elem)
    dist.reduce_scatter_tensor(red, torch.ones(world * n_elem), group=pg)
    st = paro_torch.comm_stats(pg)
    assert st.inter_bytes * g * m == (g - 1) * s and st.intra_bytes * m == (m - 1) * s, st
    assert torch.equal(red, torch.full((n_elem,), float(world)))
    # all-reduce of X bytes (a multiple of n elements): 2(g-1)/g*X/m inter, 2(m-1)/m*X intra
    x = world * 10
    paro_torch.reset_comm_stats(pg)
    t = torch.ones(x)
    dist.all_reduce(t, group=pg)
    st = paro_torch.comm_stats(pg)
    assert st.inter_bytes * g * m == 2 * (g - 1) * x * e and st.intra_bytes * m == 2 * (m - 1) * x * e, st
    assert torch.equal(t, torch.full((x,), float(world)))
    # a sub-group that takes whole groups stays hierarchical; an irregular one runs flat
    sub = dist.new_group(ranks=list(range(world - 1)), backend="paro")
    if rank < world - 1:
        t = torch.ones(5)
        paro_torch.reset_comm_stats(sub)
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((5,), float(world - 1)))
        st = paro_torch.comm_stats(sub)
        assert st.flat_ops > 0 and st.intra_ops == st.inter_ops == 0, st
    try:
        paro_torch.comm_stats(not_paro)
    except ValueError as err:
        assert 'not "paro"' in str(err), err
    else:
        raise AssertionError("comm_stats accepted a gloo group")
    print(f"rank {rank}: stats OK")


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")  # a gloo world with paro sub-groups, as new_group(backend="paro") users do
    check_counted_bytes(dist.group.WORLD)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
