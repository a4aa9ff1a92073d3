"""The engine behind ``ParoShardedModule`` (PaRO-DP), one job per module.

Per module (``paro_torch.sharded_module`` is the public face: arguments, public methods, ``_apply``):

- ``units``: which parameters form each communication unit, and a unit's training state;
- ``init``: validation on every rank, meta-device materialisation, rank 0's values, the units' buffers;
- ``planning``: the strategy ``auto`` picks (the cost model's plan), before anything is sharded;
- ``engine``: the step protocol: the hooks around forward and backward that drive the schedules below;
- ``gathers``: the gather schedule (unshard ahead of compute, reshard after, t_syncp);
- ``reducer``: gradient reductions in one fixed order on every rank (and t_syncg at the boundary);
- ``buffer_sync``: module buffers (BatchNorm statistics) made rank 0's, as DDP's ``broadcast_buffers``;
- ``state_dict``: whole and sharded state dicts;
- ``stats``: bytes and seconds of communication, memory per rank.

Per flat buffer (one unit's trainable, or frozen, parameters): ``layout`` (rows → blocks → DTensor shards),
``collectives`` (the collectives and their byte ledger), ``storage`` (unshard, reshard, views) and ``flat_buffer``
(the (g, os) schedule: reduce each micro-step, t_syncg, t_syncp).
"""
