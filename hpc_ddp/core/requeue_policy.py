"""Which way a stopped run goes on: Slurm requeues its job, or the job submits its successor (a
chain).

hpc_ddp asks for ``--requeue`` and rank 0 runs ``scontrol requeue`` at a stop. Some clusters refuse:
a job submitted with ``--no-requeue`` (``slurm.sbatch_extra: {no-requeue: ""}``), a site's submit
plugin or QOS that turns requeue off, a partition that cancels the jobs it preempts. Then
``scontrol requeue`` says "Requested operation is presently disabled" (measured on 22.05) and the
batch shell chains the next job (:mod:`hpc_ddp.shell.chain`). ``JobRequeue=0`` in slurm.conf is only
a default: an explicit ``--requeue`` overrides it (Slurm's slurm.conf manual), so it alone does not
force the chain. Pure functions over what ``scontrol show config`` / ``show partition`` print, and
:func:`requeue_path`, which asks them through a command runner (a seam for tests). No torch.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

NO_REQUEUE = "no-requeue"
CHAIN, REQUEUE = "chain", "requeue"


def asks_no_requeue(sbatch_extra: Mapping[str, str]) -> bool:
    """Whether the config's extra sbatch options turn requeue off (``no-requeue: ""``, a flag
    without value)."""
    return NO_REQUEUE in sbatch_extra


def setting(text: str, key: str) -> str | None:
    """``KEY = VALUE`` (``scontrol show config``) or ``KEY=VALUE`` (``show partition -o``); None
    when absent."""
    found = re.search(rf"(?:^|\s){re.escape(key)}\s*=\s*(\S+)", text, flags=re.M)
    return found.group(1) if found else None


def requeue_plan(sbatch_extra: Mapping[str, str], config_text: str = "", partition_text: str = "",
                 partition: str | None = None) -> tuple[str, str]:
    """(``"requeue"`` or ``"chain"``, why in a sentence) for a job of this config on this cluster.

    ``config_text``: ``scontrol show config``; ``partition_text``: ``scontrol show partition -o P``
    (either may be empty: Slurm could not be asked, and the sentence says what is assumed)."""
    chain_how = ("at each stop the batch shell submits the run's next job with "
                 "--dependency=afterany on this one, which resumes from the snapshot (a chain of "
                 "jobs, one run in status)")
    if asks_no_requeue(sbatch_extra):
        return CHAIN, f"slurm.sbatch_extra turns requeue off (--no-requeue): {chain_how}"
    where = f"partition {partition}" if partition else "the default partition"
    preempt = (setting(partition_text, "PreemptMode") or "").upper()
    default = setting(config_text, "JobRequeue")
    notes = []
    if default == "0":
        notes.append("JobRequeue=0 here is only a default: the job's --requeue overrides it")
    if "CANCEL" in preempt:
        notes.append(f"{where} cancels the jobs it preempts (PreemptMode={preempt}): rank 0 "
                     "requeues a "
                     "stopped job within the grace time, else the batch shell chains the next job")
    if not config_text:
        notes.append("Slurm's settings could not be read")
    tail = f" ({'; '.join(notes)})" if notes else ""
    return REQUEUE, ("the job asks for --requeue and rank 0 requeues it at each stop (scontrol "
                     "requeue); "
                     f"should Slurm refuse, {chain_how}{tail}")


def _scontrol(runner: Callable[..., Any], *args: str) -> str:
    try:
        proc = runner(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def requeue_path(slurm: Any, runner: Callable[..., Any] = subprocess.run) -> str:
    """Which way a run with the config's ``slurm`` section goes on after a stop on this cluster, in
    a line (the preflight's): from ``scontrol show config`` and the partition's settings (the
    default one's when unset)."""
    partitions = _scontrol(runner, "show", "partition", "-o", *([slurm.partition.split(",")[0]]
                                                                 if slurm.partition else []))
    line = next((row for row in partitions.splitlines() if slurm.partition or "Default=YES" in row),
                "")
    name = slurm.partition or next(iter(re.findall(r"PartitionName=(\S+)", line)), None)
    path, why = requeue_plan(slurm.sbatch_extra, _scontrol(runner, "show", "config"), line, name)
    return f"after a stop: {path} ({why})"
