"""One job per run dir: ``RUN_DIR/lock.json`` names the job that holds it.

Two jobs writing one run dir would interleave their snapshots and their ledger
lines. Rank 0 takes the lock when an attempt starts and gives it back when the
attempt ends. A requeued attempt of the same job takes it over. A lock left
behind by a crash is taken over once its holder is gone: a Slurm job that
``squeue`` no longer lists, or a local rehearsal whose process has died.

This uses a file and not ``flock``: flock is not reliable across the nodes
of NFS or Lustre, and a file can name its holder in the error message.
"""

from __future__ import annotations


import json
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout
from hpc_ddp.core import processes
from hpc_ddp.core.errors import HpcDdpError, explain
from hpc_ddp.core.slurm_jobs import job_state

log = logging.getLogger("hpc_ddp.runlock")
LOCK = layout.LOCK


class RunLockedError(HpcDdpError):
    """Another live job holds the run dir."""


def holder_record(job: str, *, local: bool, pid: int | None = None, host: str | None = None,
                  now: float | None = None) -> dict[str, Any]:
    """What the lock file says about its holder."""
    return {"job": job, "local": local, "host": host or socket.gethostname(), "pid": pid
            or os.getpid(),
            "since": round(now if now is not None else time.time(), 3)}


def holder_alive(holder: Mapping[str, Any], runner: Callable[..., Any] = subprocess.run) -> bool:
    """Whether the holder may still write: its local process lives, or Slurm still lists its job.

    When that cannot be told (no squeue where a Slurm job holds it), the answer is yes: refusing is
    safe, and the error says how to remove the lock.
    """
    if holder.get("local") or not job_known(holder.get("job")):
        # a task that found no job (Apptainer's --cleanenv passes no SLURM_*) is told by its process
        return _process_alive(holder)
    if not shutil.which("squeue"):
        return True
    return job_state(str(holder.get("job")), runner) is not None


def job_known(job: object) -> bool:
    """The holder named a job. A task that found no Slurm variables names none ("None"): N such
    tasks are N trainings of one, and each must refuse the others' lock, never take it over as its
    own job's (issue 57: N independent trainings wrote one run dir)."""
    return isinstance(job, str) and job not in ("", "None")


def _process_alive(holder: Mapping[str, Any]) -> bool:
    """The holder's process lives (on another host: cannot be told, so yes)."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        pid = int(holder.get("pid", 0))
    except (ValueError, TypeError):
        return False
    return pid > 0 and processes.running(pid)


def in_use(run_dir: Path, who: str, hint: str) -> RunLockedError:
    """The refusal for a run dir that a live job holds: the same words from submit and from any
    rank."""
    return RunLockedError(explain(f"run dir {run_dir} is in use by {who}",
                                  expected="one job per run dir (two would interleave snapshots)",
                                  hint=f"{hint}; for a separate run choose another run_dir=... "
                                       "(its default is "
                                  "runs/NAME, from name=...)"), key="run_dir")


def _where(holder: Mapping[str, Any]) -> str:
    since = holder.get("since")
    when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if isinstance(
        since, (int, float)) else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{when}"


def read_record(path: Path) -> dict[str, Any] | None:
    """A JSON object file of the run dir (lock, job record), or None when missing, unreadable or not
    an object."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _create(path: Path, record: Mapping[str, Any]) -> bool:
    """Create the lock file exclusively; False when it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask applies
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(dict(record), sort_keys=True) + "\n")
        out.flush()
        os.fsync(out.fileno())
    return True


def acquire(run_dir: Path, me: Mapping[str, Any],
            alive: Callable[[Mapping[str, Any]], bool] = holder_alive,
            predecessor: str | None = None) -> None:
    """Take the run dir for ``me`` or raise :class:`RunLockedError` naming the live holder.
    ``predecessor``: the job this one was chained from (``--dependency=afterany``), whose lock it
    takes over: Slurm starts the chained job while that one may still be COMPLETING (its lock not
    yet released), and refusing then ended the chain (issue 57)."""
    path = layout.lock(run_dir)
    for _ in range(3):
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            created = _create(path, me)
        except OSError as err:
            raise HpcDdpError(explain(f"cannot write the run dir {run_dir}: {err.strerror}",
                                      hint="the run needs a writable run dir with free space; the "
                                           "snapshots "
                                      "already there are untouched"), key="run_dir") from None
        if created:
            return
        holder = read_record(path)
        if holder is None:  # being written right now, or torn by a crash: look again shortly
            time.sleep(0.2)
            holder = read_record(path)
        if (holder is not None and job_known(me["job"]) and holder.get("job") == me["job"]
                and holder.get("local") == me["local"]):
            # our own job, requeued (or restarted by the local launcher)
            path.unlink(missing_ok=True)
            continue
        if holder is not None and predecessor and holder.get("job") == predecessor:
            log.info("taking over the lock of %s from job %s, which this job was chained from",
                     run_dir, predecessor)
            path.unlink(missing_ok=True)
            continue
        if holder is not None and alive(holder):
            raise in_use(run_dir, f"job {holder.get('job')} ({_where(holder)})",
                         "wait for that job or cancel it; if you are sure nothing uses it, delete "
                         f"{path}")
        log.warning("taking over the lock of %s from job %s, which is gone", run_dir,
                    holder.get("job") if holder else "(unreadable lock)")
        path.unlink(missing_ok=True)
    raise RunLockedError(explain(f"could not take the lock {path}: it keeps changing",
                                 hint="another job is starting in this run dir; start one at a "
                                      "time"),
                         key="run_dir")


def release(run_dir: Path, me: Mapping[str, Any]) -> None:
    """Give the lock back if ``me`` still holds it (a successor may have taken over a stale one)."""
    path = layout.lock(run_dir)
    holder = read_record(path)
    if holder is not None and holder.get("job") == me["job"] and holder.get("pid") == me["pid"]:
        path.unlink(missing_ok=True)
