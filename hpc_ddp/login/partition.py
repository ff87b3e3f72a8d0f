"""What the partition allows, asked before a submit; and why a queued job waits, asked by status.

A request no node set of the partition can ever meet (more nodes than it has or its ``MaxNodes``
allows, a time limit above its ``MaxTime``) is accepted by ``sbatch`` on most clusters (the default
``EnforcePartLimits=NO``) and then pends forever with a reason such as ``PartitionNodeLimit``:
preflight refuses it here, with the fix. While a job pends, :func:`pending_reason` reads Slurm's
reason and :func:`explain_reason` says it in words. Slurm is asked through a command runner (a seam
for tests). No torch.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping

from hpc_ddp.core.batching import node_counts
from hpc_ddp.core.config.hints import minutes

Runner = Callable[..., subprocess.CompletedProcess]

# Slurm's most common pending reasons (squeue %r), in a line each: what it means and what to do.
REASONS = {
    "Priority": "other jobs come first (their priority is higher); it starts when they do",
    "Resources": "it is next, waiting for enough nodes (or CPUs, GPUs, memory) to free up",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows (MaxNodes) or has: it "
                          "will never "
                          "start; scancel it and resubmit with fewer slurm.nodes (+ "
                          "slurm.spare_nodes)",
    "PartitionConfig": "the partition cannot run what it asks as configured (more nodes, CPUs or "
                       "memory than its "
                       "nodes have): it will never start; scancel it and fit the request to the "
                       "partition "
                       "(submit's preflight compares them)",
    "PartitionTimeLimit": "its time limit is above the partition's MaxTime: it will never start; "
                          "scancel it "
                          "and resubmit with a lower slurm.timeout_min",
    "PartitionDown": "the partition is down; it starts when an administrator brings it up",
    "PartitionInactive": "the partition is inactive; it starts when an administrator activates it",
    "JobHeldUser": "you held it (scontrol hold or sbatch --hold); scontrol release JOBID lets it "
                   "start",
    "JobHeldAdmin": "an administrator held it; ask them, or scancel it",
    "Dependency": "it waits for the job it depends on (--dependency) to end",
    "DependencyNeverSatisfied": "the job it depends on ended so that it can never start; scancel "
                                "it",
    "BeginTime": "it waits for its start time: a requeued job waits a little before it may start "
                 "again "
                 "(or it was submitted with --begin)",
    "ReqNodeNotAvail": "a node it needs is down, drained or reserved; it starts when the node "
                       "returns",
    "QOSMaxNodePerJobLimit": "it asks for more nodes than the QOS allows per job: it will never "
                             "start with this QOS",
    "QOSMaxWallDurationPerJobLimit": "its time limit is above the QOS's: it will never start with "
                                     "this QOS",
    "AssocGrpGRES": "your account's GPU (GRES) quota is in use by your other jobs; it starts when "
                    "they end",
    "AssocMaxJobsLimit": "your account runs as many jobs as it may; it starts when one of them "
                         "ends",
    "QOSMaxJobsPerUserLimit": "you run as many jobs as the QOS allows; it starts when one of them "
                              "ends",
    "BadConstraints": "no node has the requested features (slurm.constraint) in this combination: "
                      "it will never "
                      "start; check slurm.constraint against sinfo -o '%N %f'",
}


def fields(text: str) -> dict[str, str]:
    """``KEY=VALUE`` pairs of one ``scontrol show ... -o`` line."""
    return dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", text))


def show_partitions(name: str | None,
                    runner: Runner = subprocess.run) -> list[dict[str, str]] | str:
    """The partitions a job would use (``name``: one or several, comma-separated; None: the default
    one), as scontrol's fields; a text saying why when Slurm could not be asked."""
    if not shutil.which("scontrol") and runner is subprocess.run:
        return "scontrol is not on PATH"
    try:
        proc = runner(["scontrol", "show", "partition", "-o"], capture_output=True, text=True,
                      timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"scontrol show partition failed: {err}"
    if proc.returncode != 0:
        return f"scontrol show partition failed: {(proc.stderr or '').strip()}"
    every = [fields(line) for line in proc.stdout.splitlines() if line.strip()]
    wanted = set(name.split(",")) if name else None
    return [p for p in every if (p.get("PartitionName") in wanted if wanted
                                 else p.get("Default") == "YES")]


Problem = tuple[str, str, str, str]  # level ("error" | "warning"), config key, message, hint


def limit_problems(partition: Mapping[str, str], nodes: str | int, spares: int,
                   timeout_min: int) -> list[Problem]:
    """Why a job can never start in ``partition`` (or might get less than it asks), with the fix."""
    name = partition.get("PartitionName", "?")
    counts = node_counts(nodes)
    low, high = counts[0] + spares, counts[-1] + spares
    total = _count(partition.get("TotalNodes"))
    max_nodes = _count(partition.get("MaxNodes"))
    cap = min(c for c in (total, max_nodes) if c is not None) if (total or max_nodes) else None
    why = (f"it has {total} node(s)" if cap == total
           else f"its MaxNodes is {max_nodes}") if cap else ""
    asked = f"slurm.nodes={nodes}" + (f" + slurm.spare_nodes={spares}" if spares else "")
    found: list[Problem] = []
    if cap is not None and low > cap:
        fix = (f"set slurm.nodes={max(1, cap - spares)}"
               + (f" (with slurm.spare_nodes={spares})" if spares else "")
               if cap - spares >= 1 else f"set slurm.spare_nodes={cap - 1}, or choose a larger "
                                         "partition")
        found.append(("error", "slurm.nodes", f"the job asks for {low} node(s) ({asked}) but "
                                              f"partition {name!r} can "
                      f"never give more than {cap} ({why}): it would pend forever "
                      "(PartitionNodeLimit)",
                      f"{fix}, or choose a larger partition (slurm.partition; sinfo lists them)"))
    elif cap is not None and high > cap:
        found.append(("warning", "slurm.nodes", f"slurm.nodes={nodes} reaches {high} node(s) but "
                                                f"partition {name!r} "
                      f"gives at most {cap} ({why})", f"the job runs on at most {cap}; say so with "
                                                      "a range "
                      f"ending at {cap - spares}"))
    min_nodes = _count(partition.get("MinNodes"))
    if min_nodes and high < min_nodes:
        found.append(("error", "slurm.nodes", f"the job asks for {high} node(s) but partition "
                                              f"{name!r} takes jobs of "
                      f"at least {min_nodes} (MinNodes): it would pend forever",
                      f"set slurm.nodes={min_nodes}, "
                      "or choose another partition"))
    limit = minutes(partition.get("MaxTime", ""))
    if limit is not None and timeout_min > limit:
        found.append(("error", "slurm.timeout_min", f"slurm.timeout_min={timeout_min} is above "
                                                    f"partition {name!r}'s "
                      f"MaxTime {partition.get('MaxTime')} ({limit:g} min): it would pend forever "
                      f"(PartitionTimeLimit)", f"set slurm.timeout_min={int(limit)} (a longer run "
                                               "goes on over "
                      "requeues: each attempt snapshots before its limit)"))
    state = partition.get("State", "UP")
    if state not in ("UP", ""):
        found.append(("warning", "slurm.partition", f"partition {name!r} is {state}: the job waits "
                                                    "until it is UP",
                      "choose another partition (sinfo), or ask your administrators"))
    return found


# sinfo %t states (their suffix marks stripped) of a node a new job cannot start on until someone
# acts: busy, powered down (idle~) or booting nodes are usable, they free up or come up on their own
UNUSABLE = ("down", "drain", "drng", "fail", "maint", "inval", "resv", "futr", "future", "unk")


def usable_nodes(name: str, runner: Runner = subprocess.run) -> int | None:
    """How many of the partition's nodes a job could start on now (not down, drained, failing or
    reserved), from ``sinfo -h -p NAME -o '%D %t'``; None when sinfo cannot tell."""
    try:
        proc = runner(["sinfo", "-h", "-p", name, "-o", "%D %t"], capture_output=True, text=True,
                      timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    total = 0
    for line in proc.stdout.splitlines():
        count, _, state = line.strip().partition(" ")
        if count.isdigit() and not state.strip("*~#!%$@^-+").lower().startswith(UNUSABLE):
            total += int(count)
    return total


def _count(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def pending_reason(job_id: str, runner: Runner = subprocess.run) -> str | None:
    """Slurm's reason a job pends (squeue ``%r``: ``Priority``, ``Resources``,
    ``PartitionNodeLimit``, ...)."""
    if not job_id or (runner is subprocess.run and not shutil.which("squeue")):
        return None
    try:
        proc = runner(["squeue", "-h", "-j", job_id, "-o", "%r"], capture_output=True, text=True,
                      timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    reasons = sorted({line.strip() for line in proc.stdout.splitlines() if line.strip()})
    return ",".join(r for r in reasons if r != "None") or None if proc.returncode == 0 else None


def explain_reason(reason: str) -> str:
    """``Priority: other jobs come first ...``; Slurm's word alone for a reason without a line
    here."""
    words = [REASONS.get(part.split("(")[0].strip()) for part in reason.split(",")]
    said = "; ".join(w for w in words if w)
    return f"{reason}: {said}" if said else f"{reason} (see `man squeue`, JOB REASON CODES)"
