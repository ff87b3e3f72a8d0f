"""From the run config to what Slurm is asked for (pure: no submitit, no torch).

``submitit_parameters`` is the one place that maps config keys to sbatch options,
so the submit path and (later) the rendered templates cannot disagree.
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.config import RunConfig


def submitit_parameters(cfg: RunConfig) -> dict[str, Any]:
    """Keyword arguments for ``submitit.SlurmExecutor.update_parameters``.

    Our warning signal replaces submitit's fixed ``USR2@delay`` (``additional_parameters``
    are applied last), ``--requeue`` lets the worker's ``scontrol requeue`` work, and
    ``--kill-on-bad-exit=1`` makes one crashing task end the whole step at once instead
    of leaving the other ranks waiting in a collective.
    """
    slurm = cfg.slurm
    params: dict[str, Any] = {
        "job_name": cfg.name,
        "nodes": slurm.nodes,
        "ntasks_per_node": slurm.tasks_per_node,
        "cpus_per_task": slurm.cpus_per_task,
        "time": slurm.timeout_min,
        "signal_delay_s": slurm.signal_delay_s,
        "setup": list(slurm.setup),
        "srun_args": ["--kill-on-bad-exit=1", *slurm.srun_args],
        "additional_parameters": {"signal": f"{slurm.signal}@{slurm.signal_delay_s}", "requeue": True,
                                  **slurm.sbatch_extra},
    }
    optional = {"gpus_per_node": slurm.gpus_per_node or None, "partition": slurm.partition,
                "account": slurm.account, "qos": slurm.qos, "constraint": slurm.constraint,
                "mem": f"{slurm.mem_gb:g}GB" if slurm.mem_gb else None, "exclusive": slurm.exclusive or None}
    params.update({key: value for key, value in optional.items() if value is not None})
    return params
