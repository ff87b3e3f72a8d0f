"""The Slurm commands a job asks about itself: its end time and state (squeue), and its requeue
(``scontrol requeue``, from global rank 0 alone). Each takes a command runner (a seam for tests). No
torch.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import datetime
from collections.abc import Callable, Mapping

from hpc_ddp.core.errors import HpcDdpError, explain


class PreemptionError(HpcDdpError):
    """A requeue could not be done, or a requeue cap was reached."""


class RequeueRefused(PreemptionError):
    """Slurm refuses to requeue this job (``JobRequeue=0``, ``--no-requeue``, a partition or QOS
    that forbids it): the batch shell chains the run's next job instead
    (:mod:`hpc_ddp.shell.chain`)."""


class AlreadyRequeued(PreemptionError):
    """Slurm has requeued the job already (an admin's ``scontrol requeue``, a preemption past its
    grace time): ``scontrol requeue`` answers "Job is pending execution"; nothing is left to do, and
    nothing went wrong."""


# What ``scontrol requeue`` prints for a job Slurm has requeued already (measured on 22.05 after an
# admin's ``scontrol requeue``: "Job is pending execution for job 58").
PENDING = ("pending execution", "already pending")

# What ``scontrol requeue`` prints when the job may not be requeued (measured on 22.05 for a
# --no-requeue job: "Requested operation is presently disabled for job 5"); later releases word some
# cases differently.
REFUSALS = ("presently disabled", "not requeueable", "requeue is disabled",
            "job requeue not allowed",
            "batch job requeue not enabled")


def refused(message: str) -> bool:
    """Whether ``scontrol requeue``'s error says the job may not be requeued at all (as opposed to a
    job that is gone, a permission, or Slurm unreachable)."""
    text = message.lower()
    return any(words in text for words in REFUSALS)


def job_end_time(spec: str, runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
                 ) -> float | None:
    """The job's end time (start + time limit) from squeue, as epoch seconds; None when unknown.

    Asked once when an attempt starts: a preemption later moves the end time forward.
    (Slurm 22.05 does not put SLURM_JOB_END_TIME in the environment.)
    """
    if not spec or not shutil.which("squeue"):
        return None
    try:
        proc = runner(["squeue", "-h", "-j", spec, "-o", "%e"], capture_output=True, text=True,
                      timeout=30)
        return datetime.fromisoformat(proc.stdout.strip()).timestamp()
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def job_state(spec: str, runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
              ) -> str | None:
    """The job's state as squeue prints it (RUNNING, COMPLETING, ...); None when unknown."""
    if not spec or not shutil.which("squeue"):
        return None
    try:
        proc = runner(["squeue", "-h", "-j", spec, "-o", "%T"], capture_output=True, text=True,
                      timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


# a stop's reason, a start
JOB_FIELDS = ("JobState", "Reason", "PreemptTime", "Restarts", "EndTime", "StartTime")


def job_fields(spec: str, runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
               ) -> dict[str, str]:
    """``scontrol show job -o SPEC``'s :data:`JOB_FIELDS` (``{}`` when Slurm cannot be asked): what
    the job is going through when a SIGTERM arrives (:func:`hpc_ddp.core.stopping.term_reason`)."""
    if not spec or not shutil.which("scontrol"):
        return {}
    try:
        proc = runner(["scontrol", "show", "job", "-o", spec], capture_output=True, text=True,
                      timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    if proc.returncode != 0:
        return {}
    found = re.findall(r"(?:^|\s)(" + "|".join(JOB_FIELDS) + r")=(\S*)", proc.stdout)
    return {key: value for key, value in found}


def start_time(fields: Mapping[str, str]) -> float | None:
    """This attempt's start (``scontrol show job``'s StartTime: a requeued job's is its latest
    start), as epoch seconds; None when unknown. The batch shell's line for a step it did not start
    (submitit's) needs it: status sums the time of attempts that have a start."""
    try:
        return datetime.fromisoformat(fields.get("StartTime", "")).timestamp()
    except ValueError:
        return None


def job_spec(environ: Mapping[str, str]) -> str:
    """The id `scontrol requeue` needs: ARRAYJOB_TASK for an array element, else the job id."""
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{task}" if array_job and task else environ.get("SLURM_JOB_ID", "")


def requeue_available(which: Callable[[str], str | None] = shutil.which) -> bool:
    """Whether this process can requeue its job: containers started by srun often lack the Slurm
    client."""
    return which("scontrol") is not None


def requeue(spec: str,
            runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> None:
    """``scontrol requeue SPEC``; a clear error when scontrol is missing or refuses."""
    if not shutil.which("scontrol"):
        raise PreemptionError(explain(f"cannot requeue job {spec}: scontrol is not on PATH in the "
                                      "job",
                                      hint="the snapshot is committed: submitting the same job "
                                      "again resumes from it; to requeue by itself, the job needs "
                                      "the Slurm client (containers often lack it)"))
    proc = runner(["scontrol", "requeue", spec], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip()
        if any(words in said.lower() for words in PENDING):
            raise AlreadyRequeued(f"Slurm has requeued job {spec} already ({said})")
        error = RequeueRefused if refused(said) else PreemptionError
        raise error(explain(f"`scontrol requeue {spec}` failed: {said}",
                                      hint="requeueing needs JobRequeue=1 (or sbatch --requeue); "
                                      "where Slurm refuses it, the batch shell submits the run's "
                                      "next job itself (docs/resume.md, a chain); the snapshot is "
                                      "committed, so that job resumes from it"))
