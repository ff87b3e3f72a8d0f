"""Where Slurm refuses requeue, the batch shell submits the run's next job itself: a chain of jobs,
one run.

A cluster that refuses requeue (a job with ``--no-requeue``, a site's plugin or QOS that turns it
off) answers rank 0's ``scontrol requeue`` with "Requested operation is presently disabled" (22.05),
and a preempted ``--no-requeue`` job is cancelled at the end of its grace time. Before this job
ends, the batch shell (which outlives every step, and is signalled last) submits the same batch
script again with ``--dependency=afterany:THIS_JOB``: the next job waits in the queue until this one
has ended whatever way, then resumes from the run dir's newest snapshot, and its attempts count
against the same caps (the ledger is the run's, not the job's). The script is Slurm's own copy
(``scontrol write batch_script``), so a submitit job and a rendered template are chained alike; a
submitit job also needs its pickled call under the new job's id. The ledger's stopped line gets
``next_job``, and ``job.json`` names the new job (``status``, a second submit's guard, ``scancel``
of the chain).

Pure helpers for the commands and their environment, and one function that runs them through a
command runner (a seam for tests). No torch.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.core.errors import explain
from hpc_ddp.core.slurm_env import CHAINED_VAR, HEALED_VAR, IN_JOB_VAR
from hpc_ddp.core.timeline import TIMELINE_VAR
from hpc_ddp.core.slurm_jobs import AlreadyRequeued, PreemptionError, RequeueRefused, requeue
from hpc_ddp.rundir import layout
from hpc_ddp.rundir.ledger import attempt_fields, attempt_key, read_attempts, record_next_job

Runner = Callable[..., subprocess.CompletedProcess[str]]
# the one Slurm variable of the batch shell's environment the next sbatch needs
KEEP = ("SLURM_CONF",)
JOB_ONLY = (IN_JOB_VAR, HEALED_VAR, CHAINED_VAR, TIMELINE_VAR)  # set per step or per job by hpc_ddp
SUBMITIT = re.compile(r"-m submitit\.core\._submit\s+('[^']+'|\"[^\"]+\"|\S+)")


class ChainError(PreemptionError):
    """The next job of a chain could not be submitted (the snapshot is committed: a person's
    --resume goes on)."""


def chain_environ(environ: Mapping[str, str], job: str) -> dict[str, str]:
    """The next sbatch's environment: the batch shell's, less the variables Slurm set for this job
    (the next job gets its own; a stale ``SLURM_RESTART_COUNT`` or ``SLURM_NTASKS`` would mislead it
    and srun), plus
    :data:`CHAINED_VAR`. ``SBATCH_*`` input variables stay: they were options of the first
    submission too."""
    kept = {k: v for k, v in environ.items()
            if not (k.startswith(("SLURM_", "SRUN_", "SALLOC_")) and k not in KEEP)
            and k not in JOB_ONLY}
    return {**kept, CHAINED_VAR: job}


def sbatch_argv(script: Path, job: str, workdir: str | None) -> list[str]:
    """``sbatch --parsable --dependency=afterany:JOB [--chdir=WORKDIR] SCRIPT``: the same script,
    after this job whatever way it ends (a cancel by preemption included), in the directory the
    first was submitted from."""
    return ["sbatch", "--parsable", f"--dependency=afterany:{job}",
            *([f"--chdir={workdir}"] if workdir else []),
            str(script)]


def parsable_id(stdout: str) -> str | None:
    """The job id ``sbatch --parsable`` printed (``123`` or ``123;cluster``); None when there is
    none."""
    first = stdout.strip().splitlines()[-1].split(";")[0].strip() if stdout.strip() else ""
    return first if first.isdigit() else None


def submitit_folder(script_text: str) -> Path | None:
    """The folder of submitit's pickles named by a submitit batch script (None: not submitit's
    script)."""
    found = SUBMITIT.search(script_text)
    return Path(found.group(1).strip("'\"")) if found else None


def workdir_of(show_job: str) -> str | None:
    """``WorkDir=`` of ``scontrol show job -o``: where the job runs (a path may hold spaces: it ends
    where the next ``Key=`` begins)."""
    found = re.search(r"(?:^|\s)WorkDir=(.*?)(?=\s+[A-Z][A-Za-z]*=|\s*$)", show_job, flags=re.M)
    return found.group(1) if found and found.group(1) else None


def chain_problem(environ: Mapping[str, str]) -> str:
    """Why this job cannot chain its successor; empty when it can."""
    if environ.get("SLURM_ARRAY_JOB_ID"):
        return ("a job array's element is not chained (its script would submit the whole array "
                "again): "
                "resubmit it with `python -m hpc_ddp.submit RUN_DIR --resume`")
    if not environ.get("SLURM_JOB_ID", "").isdigit():
        return "no SLURM_JOB_ID in the batch shell's environment"
    if shutil.which("sbatch", path=environ.get("PATH")) is None:
        return "sbatch is not on the batch shell's PATH"
    return ""


def _run(runner: Runner, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    proc = runner(list(argv), capture_output=True, text=True, timeout=60, **kwargs)
    if proc.returncode != 0:
        raise ChainError(explain(f"`{' '.join(argv)}` failed: "
                                 f"{(proc.stderr or proc.stdout).strip()}",
                                 hint="the snapshot is committed: `python -m hpc_ddp.submit "
                                      "RUN_DIR --resume` "
                                 "continues the run"))
    return proc


def submit_next(run_dir: Path, environ: Mapping[str, str],
                runner: Runner = subprocess.run) -> tuple[str, Path]:
    """Submit the run's next job after this one (``SLURM_JOB_ID``): Slurm's copy of the batch
    script, sbatch with the dependency, submitit's pickle under the new id. Returns (new job id, the
    script submitted)."""
    job = environ["SLURM_JOB_ID"]
    script = layout.chain_script(run_dir, job)
    script.parent.mkdir(parents=True, exist_ok=True)
    _run(runner, ["scontrol", "write", "batch_script", job, str(script)])
    shown = runner(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                   timeout=60)
    workdir = (workdir_of(shown.stdout) if shown.returncode == 0
               else None) or environ.get("SLURM_SUBMIT_DIR")
    proc = _run(runner, sbatch_argv(script, job, workdir), env=chain_environ(environ, job),
                cwd=workdir)
    new = parsable_id(proc.stdout)
    if new is None:
        raise ChainError(f"sbatch printed no job id: {proc.stdout.strip()!r}")
    folder = submitit_folder(script.read_text(errors="replace"))
    # submitit's worker loads FOLDER/<its job id>_submitted.pkl: the same call, new id
    if folder is not None:
        try:
            shutil.copyfile(folder / f"{job}_submitted.pkl", folder / f"{new}_submitted.pkl")
        except OSError as err:  # the next job would wait for its pickle and fail: take it back
            runner(["scancel", new], capture_output=True, text=True, timeout=60)
            raise ChainError(f"job {new} was submitted but submitit's call could not be copied for "
                             f"it ({err}); "
                             "it was cancelled") from None
    return new, script


def note_job(run_dir: Path, new: str, chained_from: str) -> None:
    """job.json names the chained job: status shows its state, a second submit is refused while it
    is queued."""
    path = layout.job(run_dir)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {}
    record = {**(record if isinstance(record, dict) else {}), "job_id": new,
              "chained_from": chained_from,
              "submitted": time.time()}
    path.write_text(json.dumps(record) + "\n")


def requeue_or_chain(run_dir: Path, attempt: Mapping[str, Any], spec: str,
                     environ: Mapping[str, str],
                     runner: Runner = subprocess.run, *, refused_before: bool = False) -> str:
    """The batch shell's requeue: ``scontrol requeue``, or, where Slurm refuses it
    (``refused_before``: rank 0 was refused already), the chain's next job. Returns what was done,
    in words; raises when neither worked."""
    if not refused_before:
        try:
            requeue(spec, runner)
            return "requeued"
        except AlreadyRequeued:  # an admin's `scontrol requeue` came first
            return "requeued by Slurm already"
        except RequeueRefused:
            pass
    problem = chain_problem(environ)
    if problem:
        raise ChainError(explain(f"Slurm refuses to requeue job {spec} and the batch shell cannot "
                                 f"chain: {problem}",
                                 hint="the snapshot is committed: `python -m hpc_ddp.submit "
                                      "RUN_DIR --resume` "
                                 "continues the run"))
    new, script = submit_next(run_dir, environ, runner)
    record_next_job(run_dir, attempt, new, str(script))
    note_job(run_dir, new, environ["SLURM_JOB_ID"])
    return (f"Slurm refuses requeue, so the batch shell queued the run's next job {new} after this "
            "one "
            f"(--dependency=afterany:{environ['SLURM_JOB_ID']}); it resumes from the snapshot")


def batch_shell_requeue(run_dir: Path, key: tuple[Any, int, int], spec: str,
                        environ: Mapping[str, str],
                        runner: Runner = subprocess.run) -> Callable[[], str]:
    """The batch shell's requeue of the attempt ``key`` (job, requeue count, in-job restart), for
    :func:`hpc_ddp.shell.settle.settle`: requeue, else chain; a failure of both is said, not raised
    (the attempt's line is in the ledger whatever happens, and the job must still end)."""
    def go() -> str:
        mine = [a for a in read_attempts(run_dir) if attempt_key(a) == key]
        refused = bool(mine and mine[-1].get("requeue_refused"))
        try:
            return requeue_or_chain(run_dir, attempt_fields(*key), spec, environ, runner,
                                    refused_before=refused)
        except PreemptionError as err:
            return f"not requeued: {err}"
    return go
