"""Preflight's checks that ask Slurm: its client commands on PATH, the partition, its limits
against the request and the nodes up now, and the Slurm behaviour the job is planned for.

Apart from the checks that need only the config: ``--emit-sbatch`` leaves these out (it asks no
Slurm), and each goes through a command runner (``runner``, a seam for tests). No torch.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable

from hpc_ddp.core.batching import node_counts
from hpc_ddp.core.config import RunConfig
from hpc_ddp.login.preflight.finding import Finding
from hpc_ddp.login.preflight.slurm_version import planned_for

# submitit needs sbatch and squeue (and looks for srun); the partition check needs sinfo.
SLURM_COMMANDS = ("sbatch", "squeue", "srun", "sinfo")
Runner = Callable[..., subprocess.CompletedProcess]


def check_commands(which: Callable[[str], str | None] = shutil.which) -> list[Finding]:
    missing = [cmd for cmd in SLURM_COMMANDS if which(cmd) is None]
    if not missing:
        return []
    return [Finding("error", "PATH", f"Slurm client commands not found: {', '.join(missing)}",
                    "submit from a login node of the cluster (module load slurm, if your site uses "
                    "modules); "
                    "on a laptop, rehearse with --local or look with --dry-run")]


def check_partition(partition: str | None, runner: Runner = subprocess.run) -> list[Finding]:
    """The partition must be one ``sinfo`` lists (the default partition is marked with ``*``)."""
    if not partition:
        return []
    try:
        proc = runner(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return [Finding("warning", "slurm.partition", f"could not ask sinfo for partitions: {err}",
                        "check that Slurm answers (sinfo) before trusting the submit")]
    names = sorted({name.strip().rstrip("*") for name in proc.stdout.split() if name.strip()})
    if proc.returncode != 0:
        return [Finding("warning", "slurm.partition",
                        f"sinfo failed: {(proc.stderr or '').strip()}",
                        "check that Slurm answers (sinfo) before trusting the submit")]
    if partition in names:
        return []
    return [Finding("error", "slurm.partition", f"partition {partition!r} does not exist; sinfo "
                                                "lists "
                    f"{', '.join(names) or 'none'}", "set slurm.partition to one of "
                                                     f"{', '.join(names) or '(none)'}"
                    ", or slurm.partition=null for the cluster's default")]


def check_slurm_version(cfg: RunConfig, runner: Runner = subprocess.run) -> list[Finding]:
    """A note of the Slurm behaviour the job is planned for
    (:mod:`hpc_ddp.login.preflight.slurm_version`)."""
    return [Finding("note", "slurm.cpus_per_task", planned_for(cfg.slurm.cpus_per_task, runner),
                    "")]


def check_partition_limits(cfg: RunConfig, runner: Runner = subprocess.run) -> list[Finding]:
    """The request against the partition's nodes, MaxNodes, MinNodes and MaxTime
    (:mod:`hpc_ddp.login.partition`): what can never start is an error. With several partitions
    (``a,b``) only what none of them can run."""
    from hpc_ddp.login.partition import limit_problems, show_partitions

    slurm = cfg.slurm
    partitions = show_partitions(slurm.partition, runner)
    if isinstance(partitions, str):
        return [Finding("warning", "slurm.partition", "could not read the partition's limits: "
                                                      f"{partitions}",
                        "check that Slurm answers (scontrol show partition) before trusting the "
                        "submit")]
    each = [[Finding(*p) for p in limit_problems(part, slurm.nodes, slurm.spare_nodes,
                                                 slurm.timeout_min)]
            for part in partitions]
    # a request that fits: are enough of the nodes up now?
    for part, found in zip(partitions, each):
        if not any(f.level == "error" for f in found):
            found += _down_nodes(part.get("PartitionName", ""), node_counts(slurm.nodes)[0]
                                 + slurm.spare_nodes,
                                 runner)
    if len(each) > 1 and any(not any(f.level == "error" for f in found) for found in each):
        # one partition can run it
        return [f for found in each for f in found if f.level == "warning"]
    return [f for found in each for f in found]


def _down_nodes(name: str, needed: int, runner: Runner) -> list[Finding]:
    """A warning when fewer of the partition's nodes are up than the job needs: it waits until they
    return."""
    from hpc_ddp.login.partition import usable_nodes

    usable = usable_nodes(name, runner) if name else None
    if usable is None or usable >= needed:
        return []
    return [Finding("warning", "slurm.nodes", f"only {usable} of partition {name!r}'s nodes can "
                                              "take a job now (the "
                    f"others are down, drained or reserved: sinfo -p {name}) and the job needs "
                    f"{needed}",
                    "it waits until enough return (squeue shows ReqNodeNotAvail or Resources); "
                    "fewer slurm.nodes "
                    "start sooner")]
