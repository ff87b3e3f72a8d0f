"""hpc_ddp: PyTorch DDP on Slurm that survives preemption and time limits.

Importing the package is light (no torch): the login-node path stays fast. The
training-side API is loaded on first use::

    from hpc_ddp import Run, ShardSampler, per_rank, session   # torch is imported here
    from hpc_ddp import worker_init   # DataLoader(..., worker_init_fn=worker_init()): no torch
"""

from __future__ import annotations

from typing import Any

from hpc_ddp import compat
from hpc_ddp.core.errors import ClusterError, ConfigError, HpcDdpError, SlurmEnvError, UsageError
from hpc_ddp.core.version import VERSION as __version__

__all__ = ["ClusterError", "ConfigError", "HpcDdpError", "Run", "ShardSampler", "SlurmEnvError",
           "UsageError",
           "__version__", "per_rank", "session", "worker_init"]
_LAZY = {"Run": "hpc_ddp.rank.loop.run", "ShardSampler": "hpc_ddp.rank.loop.sampler",
         "session": "hpc_ddp.rank.worker",
         "per_rank": "hpc_ddp.rank.state.tracked", "worker_init": "hpc_ddp.rank.stop.shield"}


compat.install()  # hpc_ddp.config, hpc_ddp.sampler, ... (0.1's paths) keep working, with a warning


def __getattr__(name: str) -> Any:
    """``hpc_ddp.Run``, ``hpc_ddp.ShardSampler``, ``hpc_ddp.per_rank`` and ``hpc_ddp.session``
    import torch only when asked for."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpc_ddp' has no attribute {name!r}")
