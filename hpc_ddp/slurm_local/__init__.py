"""A real multi-node Slurm cluster on one machine, for tests and for rehearsing a job.

``python -m hpc_ddp.slurm_local start`` (as root) brings up munge, MariaDB +
slurmdbd, slurmctld and N slurmd "nodes"; ``eval "$(python -m hpc_ddp.slurm_local env)"``
points ``sbatch``/``srun``/``squeue`` at it; ``stop`` ends exactly what ``start`` began.
"""

from hpc_ddp.slurm_local.conf import ClusterSpec, render_slurm_conf, render_slurmdbd_conf
from hpc_ddp.slurm_local.daemons import (APT_PACKAGES, is_up, missing_pieces, running_spec,
                                         set_preempt_signal, start,
                                         stop)

__all__ = ["APT_PACKAGES", "ClusterSpec", "is_up", "missing_pieces", "render_slurm_conf",
           "render_slurmdbd_conf", "running_spec", "set_preempt_signal", "start", "stop"]
