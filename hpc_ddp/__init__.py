"""hpc_ddp: PyTorch DDP on Slurm that survives preemption and time limits.

Importing the package is light (no torch): the login-node path stays fast. The
training-side API is loaded on first use::

    from hpc_ddp import Run, ShardSampler, per_rank, session   # torch is imported here
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.errors import ClusterError, ConfigError, HpcDdpError, SlurmEnvError, UsageError

__all__ = ["ClusterError", "ConfigError", "HpcDdpError", "Run", "ShardSampler", "SlurmEnvError", "UsageError",
           "__version__", "per_rank", "session"]
__version__ = "0.1.0"
_LAZY = {"Run": "hpc_ddp.run", "ShardSampler": "hpc_ddp.sampler", "session": "hpc_ddp.worker",
         "per_rank": "hpc_ddp.tracked"}


def __getattr__(name: str) -> Any:
    """``hpc_ddp.Run``, ``hpc_ddp.ShardSampler``, ``hpc_ddp.per_rank`` and ``hpc_ddp.session`` import torch
    only when asked for."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpc_ddp' has no attribute {name!r}")
