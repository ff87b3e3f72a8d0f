"""Which Slurm the job is planned for, said by preflight: srun's handling of ``--cpus-per-task``
changed twice.

Before 22.05 srun inherited the job's ``--cpus-per-task``; from 22.05 it does not (only through
``SRUN_CPUS_PER_TASK``: a rank may get one core for its threads and data-loader workers,
Lightning#18650, reframe#2655); 23.11 reads ``SLURM_CPUS_PER_TASK`` again (webknossos-libs#1483
quotes SchedMD). hpc_ddp passes ``--cpus-per-task`` to every srun whatever the version, and every
rank checks its affinity at start (:mod:`hpc_ddp.core.binding`); the note says which behaviour this
cluster has. No torch.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

Runner = Callable[..., subprocess.CompletedProcess]


def slurm_version(text: str) -> tuple[int, int] | None:
    """(22, 5) from ``srun --version``'s "slurm 22.05.8" (or "slurm-wlm 22.05.8"); None when it says
    no version."""
    match = re.search(r"\b(\d+)\.(\d+)(?:\.\d+)?", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def cpus_behaviour(version: tuple[int, int] | None, cpus: int, shown: str = "") -> str:
    """Which srun behaviour for ``--cpus-per-task`` this Slurm has, and what hpc_ddp does about
    it."""
    ours = f"hpc_ddp passes --cpus-per-task={cpus} to every srun and exports SRUN_CPUS_PER_TASK"
    if version is None:
        return (f"Slurm's version is unknown ({shown or 'srun --version said nothing'}): {ours}, "
                "as every version needs")
    name = f"Slurm {version[0]}.{version[1]:02d}"
    if version < (22, 5):
        return f"{name}: srun inherits --cpus-per-task from the job; {ours} all the same"
    if version < (23, 11):
        return (f"{name}: srun does not inherit --cpus-per-task from the job (only through "
                "SRUN_CPUS_PER_TASK); "
                f"{ours}; every rank checks its CPU affinity at start")
    return f"{name}: srun reads SLURM_CPUS_PER_TASK again (since 23.11); {ours} all the same"


def planned_for(cpus: int, runner: Runner = subprocess.run) -> str:
    """:func:`cpus_behaviour` of the Slurm that ``srun --version`` names (through ``runner``, the
    seam)."""
    try:
        proc = runner(["srun", "--version"], capture_output=True, text=True, timeout=30)
        text = (proc.stdout or "").strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        text = f"srun --version failed: {err}"
    return cpus_behaviour(slurm_version(text), cpus, text.splitlines()[0] if text else "")
