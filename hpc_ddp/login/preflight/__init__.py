"""Checks on the login node before a job is submitted: cheap now, expensive in the queue.

Each check returns :class:`Finding` s: an error stops the submit, a warning is
printed; both carry a HINT. Side effects sit behind seams (``which``, ``runner``,
the mounts table, ``sys.path``) so every check is tested with its message. No
torch, and no user code runs: the task module is located, never imported.

One module per kind of check: :mod:`~hpc_ddp.login.preflight.run_dir`,
:mod:`~hpc_ddp.login.preflight.request` (the config against itself and this node),
:mod:`~hpc_ddp.login.preflight.program` (the task, loop or script),
:mod:`~hpc_ddp.login.preflight.slurm` (what asks Slurm) and
:mod:`~hpc_ddp.login.preflight.slurm_version`; :func:`preflight` runs them all.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from hpc_ddp.core.config import RunConfig
from hpc_ddp.login.preflight.finding import Finding
from hpc_ddp.login.preflight.program import (check_script, check_task, defines, find_module,
                                             module_origin)
from hpc_ddp.login.preflight.request import (check_container, check_geometry, check_metrics,
                                             check_open_files, check_replace,
                                             check_signal_delay)
from hpc_ddp.login.preflight.run_dir import (NODE_LOCAL_FSTYPES, NODE_LOCAL_PREFIXES, check_run_dir,
                                             check_run_dir_writers)
from hpc_ddp.login.preflight.slurm import (SLURM_COMMANDS, Runner, check_commands, check_partition,
                                           check_partition_limits, check_slurm_version)

__all__ = ["NODE_LOCAL_FSTYPES", "NODE_LOCAL_PREFIXES", "SLURM_COMMANDS", "Finding", "Runner",
           "check_commands", "check_container", "check_replace", "check_geometry", "check_metrics",
           "check_open_files", "check_partition", "check_partition_limits", "check_run_dir",
           "check_run_dir_writers", "check_script", "check_signal_delay", "check_slurm_version",
           "check_task", "defines", "find_module", "module_origin", "preflight"]


def preflight(cfg: RunConfig, *, slurm: bool = True,
              which: Callable[[str], str | None] = shutil.which,
              runner: Runner = subprocess.run) -> list[Finding]:
    """All checks for ``cfg``; ``slurm=False`` leaves out those that ask Slurm (for
    --emit-sbatch)."""
    findings = [*check_run_dir(Path(cfg.run_dir)), *check_run_dir_writers(cfg),
                *check_signal_delay(cfg),
                *check_geometry(cfg), *check_open_files(cfg), *check_task(cfg), *check_metrics(cfg),
                *check_replace(cfg),
                *check_container(cfg, which)]
    if slurm:
        commands = check_commands(which)
        asked = [] if commands else check_partition(cfg.slurm.partition, runner)
        # of a partition that exists
        limits_of = [] if commands or asked else check_partition_limits(cfg, runner)
        findings = commands + findings + asked + limits_of + ([] if commands
                                                              else check_slurm_version(cfg, runner))
    return findings
