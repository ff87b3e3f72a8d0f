"""Which way a stopped run goes on: Slurm requeues its job, or the job submits its successor (a chain).

hpc_ddp asks for ``--requeue`` and rank 0 runs ``scontrol requeue`` at a stop. Some clusters refuse:
a job submitted with ``--no-requeue`` (``slurm.sbatch_extra: {no-requeue: ""}``), a site's submit
plugin or QOS that turns requeue off, a partition that cancels the jobs it preempts. Then
``scontrol requeue`` says "Requested operation is presently disabled" (measured on 22.05) and the
batch shell chains the next job (:mod:`hpc_ddp.shell.chain`). ``JobRequeue=0`` in slurm.conf is only
a default: an explicit ``--requeue`` overrides it (Slurm's slurm.conf manual), so it alone does not
force the chain. Pure functions over what ``scontrol show config`` / ``show partition`` print. No torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

NO_REQUEUE = "no-requeue"
CHAIN, REQUEUE = "chain", "requeue"


def asks_no_requeue(sbatch_extra: Mapping[str, str]) -> bool:
    """Whether the config's extra sbatch options turn requeue off (``no-requeue: ""``, a flag without value)."""
    return NO_REQUEUE in sbatch_extra


def setting(text: str, key: str) -> str | None:
    """``KEY = VALUE`` (``scontrol show config``) or ``KEY=VALUE`` (``show partition -o``); None when absent."""
    found = re.search(rf"(?:^|\s){re.escape(key)}\s*=\s*(\S+)", text, flags=re.M)
    return found.group(1) if found else None


def requeue_plan(sbatch_extra: Mapping[str, str], config_text: str = "", partition_text: str = "",
                 partition: str | None = None) -> tuple[str, str]:
    """(``"requeue"`` or ``"chain"``, why in a sentence) for a job of this config on this cluster.

    ``config_text``: ``scontrol show config``; ``partition_text``: ``scontrol show partition -o P``
    (either may be empty: Slurm could not be asked, and the sentence says what is assumed)."""
    chain_how = ("at each stop the batch shell submits the run's next job with --dependency=afterany on "
                 "this one, which resumes from the snapshot (a chain of jobs, one run in status)")
    if asks_no_requeue(sbatch_extra):
        return CHAIN, f"slurm.sbatch_extra turns requeue off (--no-requeue): {chain_how}"
    where = f"partition {partition}" if partition else "the default partition"
    preempt = (setting(partition_text, "PreemptMode") or "").upper()
    default = setting(config_text, "JobRequeue")
    notes = []
    if default == "0":
        notes.append("JobRequeue=0 here is only a default: the job's --requeue overrides it")
    if "CANCEL" in preempt:
        notes.append(f"{where} cancels the jobs it preempts (PreemptMode={preempt}): rank 0 requeues a "
                     "stopped job within the grace time, else the batch shell chains the next job")
    if not config_text:
        notes.append("Slurm's settings could not be read")
    tail = f" ({'; '.join(notes)})" if notes else ""
    return REQUEUE, ("the job asks for --requeue and rank 0 requeues it at each stop (scontrol requeue); "
                     f"should Slurm refuse, {chain_how}{tail}")
