"""hpc_ddp: PyTorch DDP on Slurm that survives preemption and time limits.

Importing the package is light (no torch): the login-node path stays fast.
"""

from hpc_ddp.errors import ClusterError, ConfigError, HpcDdpError, SlurmEnvError

__all__ = ["ClusterError", "ConfigError", "HpcDdpError", "SlurmEnvError", "__version__"]
__version__ = "0.1.0"
