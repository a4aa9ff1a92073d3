"""paro-torch: PaRO (arXiv 2310.06003) for PyTorch.

PaRO-DP shards parameters, gradients and optimizer states each at its own granularity (N, I, G);
PaRO-CC runs collectives hierarchically as the ``paro`` torch.distributed backend; a cost model picks
the strategy.
"""

import torch  # noqa: F401  (loads libtorch before the extension that links it)

import paro_torch._torch_check  # noqa: F401  (refuses another torch minor, before the extension loads)
from paro_torch import _C  # noqa: F401  (the compiled core)
from paro_torch._backend import CommStats, ParoBackendOptions, comm_stats, register, reset_comm_stats
from paro_torch._C import ALIASES, STRATEGIES, InvalidStrategyError, Strategy, TopologyError
from paro_torch.auto import Link, LinkCalibration, calibrate
from paro_torch.sharded_module import ParoShardedModule

register()

__all__ = [
    "ALIASES",
    "STRATEGIES",
    "CommStats",
    "InvalidStrategyError",
    "Link",
    "LinkCalibration",
    "ParoBackendOptions",
    "ParoShardedModule",
    "Strategy",
    "TopologyError",
    "calibrate",
    "comm_stats",
    "register",
    "reset_comm_stats",
]

__version__: str = _C.__version__  # the Cargo workspace's version, as the package metadata's
