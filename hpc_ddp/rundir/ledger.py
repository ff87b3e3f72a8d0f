"""The ledger of attempts (``RUN_DIR/attempts.jsonl``) and the files an attempt leaves for the next:
one line per attempt, ``amends`` lines merged into it, a person's ``--resume`` from which the caps
count afresh, the error files and crash markers. Written by ranks, the batch shell and the
rehearsal, read by all of them and by ``status``; its summaries of a run as a whole (the steps
each failure lost, the chain of jobs) are :mod:`hpc_ddp.rundir.ledger_history`'s. No torch.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import layout, ledger_schema
from hpc_ddp.core.atomic import append_line
from hpc_ddp.core.codes import EXIT_ERROR
from hpc_ddp.core.errors import explain


log = logging.getLogger("hpc_ddp.ledger")

LEDGER = layout.LEDGER
# RUN_DIR/errors/job-J-restart-N.txt: the full message of an attempt's deterministic error
ERRORS = layout.ERRORS
# the attempts that end in a requeue ("requeued": Slurm's
STOP_REASONS = ("timeout", "preemption", "requeued")
# own, an admin's `scontrol requeue` or a preemption past its grace time; no cap counts it, none
# could stop it) A ledger line {"caps_from": "resume", "time": T}, no attempt: a person's --resume,
# from which the caps count afresh. read_attempts leaves it out and marks every attempt before it
# BEFORE_RESUME, which the caps skip.
CAPS_FROM, BEFORE_RESUME = "caps_from", "before_resume"
# Why an attempt ended -> the cap that counts it (a hang counts as a failure).
REASONS_CAPPED = {"timeout": "max_timeouts", "preemption": "max_preemptions",
                  "failed": "max_failures",
                  "hung": "max_failures", "lost": "max_failures"}


def name_the_ledger(run_dir: Path) -> None:
    """Make this node's view of the ledger's name current before reading it: an open with O_CREAT
    (an empty ledger where none is yet). A node whose NFS client (or the local cluster's cached
    view) looked the ledger up while it was absent keeps that absence for up to ``acdirmax``: the
    batch shell did, at the job's start, and then missed the ranks' first line, written seconds
    before the step ended on another node, and added a ``failed`` line of its own (seen on the local
    cluster of machines). A create is decided by the server, whatever the cache says, and leaves the
    name known here. Nothing when the run dir is missing."""
    path = layout.ledger(run_dir)
    if not Path(run_dir).is_dir():
        return
    try:
        os.close(os.open(path,
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644))
    except OSError:
        pass  # read as it can be: read_attempts says nothing new then


def read_attempts(run_dir: Path) -> list[dict[str, Any]]:
    """The ledger, one dict per ended attempt (unreadable lines are skipped; ``amends`` lines are
    merged into their attempt's line; a ``caps_from`` line, a person's ``--resume``, is no attempt:
    the attempts before it get ``"before_resume": true``, which the caps skip). Only well-typed
    lines are read (:mod:`hpc_ddp.rundir.ledger_schema`); each other one is a warning that names
    it."""
    path = layout.ledger(run_dir)
    try:
        return parse_attempts(path.read_text(errors="replace"), str(path))
    except OSError:
        return []


def parse_attempts(text: str, where: str = LEDGER) -> list[dict[str, Any]]:
    """:func:`read_attempts` of the ledger's text (a node's copy of it:
    :mod:`hpc_ddp.rundir.node_share`); ``where``: the file, for the warnings."""
    attempts: list[dict[str, Any]] = []
    for record in _records(text, where):
        if record.get("amends"):
            _amend(attempts, record)
        elif CAPS_FROM in record:
            for earlier in attempts:
                earlier[BEFORE_RESUME] = True
        else:
            attempts.append(record)
    return attempts


def _records(text: str, where: str) -> list[dict[str, Any]]:
    """The ledger's well-typed lines. A line that is not one is named in a warning and skipped; the
    last line, without its newline, may be in the writing (or torn by a crash): skipped without a
    word."""
    # the numbers a person's editor shows; the last piece has no newline (yet)
    lines = text.split("\n")
    found = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            if number < len(lines):
                log.warning("%s line %d skipped: it is not JSON (a line cut short by a crash or a "
                            "full disk?): "
                            "%.80s", where, number, line)
            continue
        wrong = ledger_schema.problems(record)
        if wrong:
            log.warning("%s line %d skipped: %s (every reader skips it: fix the line or delete it)",
                        where, number, "; ".join(wrong))
            continue
        found.append(record)
    return found


def start_caps_afresh(run_dir: Path, why: str = "resume") -> None:
    """A person's ``--resume`` is an attended decision: the requeue caps count only the attempts
    after it.

    Without this, a run stopped by its cap ("--resume continues it") was refused by its own cap at
    the next start. Written on the login node before the job is submitted; unattended requeues never
    write it.
    """
    append_attempt(run_dir, {CAPS_FROM: why, "time": round(time.time(), 3)})


def _amend(attempts: list[dict[str, Any]], amendment: Mapping[str, Any]) -> None:
    """An ``amends`` line adds fields to its attempt's line (the batch shell writes a failed
    attempt's line before it decides anything, and what it decided after): one attempt, one
    record."""
    key = attempt_key(amendment)
    for record in reversed(attempts):
        if attempt_key(record) == key:
            record.update({k: v for k, v in amendment.items() if k != "amends"})
            return


def append_attempt(run_dir: Path, record: Mapping[str, Any]) -> None:
    """One line per attempt, appended and fsynced (rank 0 only). A write that fails (a full disk)
    leaves the ledger as it was and raises the OSError (:func:`hpc_ddp.core.atomic.append_line`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # whole, or not at all
    append_line(layout.ledger(run_dir), json.dumps(dict(record), sort_keys=True) + "\n")


def attempt_tag(job_id: int | str | None, restart_count: int, in_job: int = 0) -> str:
    """How an attempt's files are named: ``job-J-restart-R``, plus ``-step-K`` for the K-th in-job
    restart."""
    return f"job-{job_id}-restart-{restart_count}" + (f"-step-{in_job}" if in_job else "")


def attempt_fields(job_id: int | None, restart_count: int, in_job: int = 0) -> dict[str, Any]:
    """A ledger line's identity: job id, requeue count and, for an in-job restart, ``in_job``."""
    return {"job_id": job_id, "restart_count": restart_count,
            **({"in_job": in_job} if in_job else {})}


def caps(slurm: Any) -> dict[str, int]:
    """The requeue caps of a config's ``slurm`` section, by name (what :func:`cap_reached`
    takes)."""
    return {key: getattr(slurm, key) for key in set(REASONS_CAPPED.values())}


def attempt_key(record: Mapping[str, Any]) -> tuple[Any, int, int]:
    """Which attempt a ledger line belongs to: job id, requeue count and in-job restart (absent:
    0)."""
    return record.get("job_id"), int(record.get("restart_count") or 0), int(record.get("in_job")
                                                                            or 0)


def crash_marker(run_dir: Path, job_id: int | str | None, restart_count: int, in_job: int,
                 rank: int | str,
                 kind: str = "crash") -> Path:
    """Where a rank's crash (a wrapped script's, or a lost node's), or the stop it forwarded
    (``kind="stop"``), is noted for the other ranks' workers. Peers read it by this name, rank by
    rank, never by listing the directory (NFS caches listings): see
    :mod:`hpc_ddp.rank.script.outcome`."""
    tag = attempt_tag(job_id, restart_count, in_job)
    return layout.errors(run_dir) / f"{tag}-{kind}-rank-{rank}.txt"


def error_path(run_dir: Path, job_id: int | str | None, restart_count: int,
               in_job: int = 0) -> Path:
    return layout.errors(run_dir) / f"{attempt_tag(job_id, restart_count, in_job)}.txt"


def _create_once(path: Path, message: str) -> bool:
    """Write the message to a new file; False when another rank created it first (or it cannot be
    written)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    # FileExistsError: another rank was first; else an unwritable run dir (printed anyway)
    except OSError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(message.rstrip() + "\n")
        out.flush()
        os.fsync(out.fileno())
    return True


def note_error(run_dir: Path, record: Mapping[str, Any], message: str) -> bool:
    """A failure a retry may fix (a taken rendezvous port): its message for the other ranks and
    ``status``, but no ``error`` line; the batch shell settles the attempt as ``failed`` and heals
    or requeues it."""
    return _create_once(error_path(run_dir, *attempt_key(record)), message)


def record_error(run_dir: Path, record: Mapping[str, Any], message: str) -> bool:
    """The first rank of an attempt to fail with a deterministic error records it; True for that
    rank.

    Every rank usually fails the same way at nearly the same time (a missing task class, a
    bad geometry), and srun's exit code cannot tell the batch shell (it reports the ranks it
    terminated: 143). So the ranks record it themselves: the message file is created
    exclusively (O_EXCL works across the nodes of NFS and Lustre), and only its creator adds the
    ledger line, so there is one line per attempt however many ranks fail.
    """
    if not _create_once(error_path(run_dir, *attempt_key(record)), message):
        return False
    append_attempt(run_dir, {**record, "reason": "error", "exit_code": EXIT_ERROR,
                             "message": message.splitlines()[0]})
    return True


def recorded_error(run_dir: Path, job_id: int | str | None, restart_count: int,
                   in_job: int = 0) -> str | None:
    """The message another rank of this attempt recorded, if one did."""
    try:
        return error_path(run_dir, job_id, restart_count, in_job).read_text().rstrip() or None
    except OSError:
        return None


def healed_in_job(attempts: Sequence[Mapping[str, Any]]) -> set[tuple[Any, int, int]]:
    """The attempts the batch shell followed with another step in the same job: they cost no
    requeue, so ``max_failures`` does not count them (``slurm.max_restarts_in_job`` does)."""
    keys = [attempt_key(a) for a in attempts]
    later = {(job, restart, in_job - 1) for job, restart, in_job in keys if in_job}
    return {key for key in keys if key in later}


def cap_reached(reason: str, attempts: Sequence[Mapping[str, Any]],
                limits: Mapping[str, int]) -> str | None:
    """A message when this attempt's reason exceeds its cap (counting this attempt), else None.
    Attempts before the last ``--resume`` (marked by :func:`read_attempts`) do not count: a person's
    resume starts afresh."""
    key = REASONS_CAPPED.get(reason)
    if key is None:
        return None
    healed = healed_in_job(attempts)
    counted = [a for a in attempts if REASONS_CAPPED.get(a.get("reason", "")) == key
               and attempt_key(a) not in healed and not a.get(BEFORE_RESUME)]
    count = len(counted)
    if count <= limits[key]:
        return None
    kinds = "failures and hangs" if key == "max_failures" else reason
    since = " since its last --resume" if any(a.get(BEFORE_RESUME) for a in attempts) else ""
    times = "once" if count == 1 else f"{count} times"
    resume = ("--resume continues it from the newest snapshot, with its caps counted afresh; to "
              "allow more per submission, raise the cap on that command line "
              f"(slurm.{key}={limits[key] + 10})")
    if reason == "failed" and all(a.get("reason") == "failed" and a.get("last_step") is None
                                  for a in counted):
        # a program that fails at its start (an import, a missing file, no GPU) fails so again
        resume = ("every failure came before the program's first step: it fails at its start the "
                  "same way each time (its error is in rank 0's log; `python -m hpc_ddp.status "
                  "RUN_DIR` shows the last lines), and a higher cap would only run it again. Fix "
                  "that first; where a node was at fault, " + resume)
    elif reason == "hung":
        # a hang in the program repeats on any node and at any cap: where it is comes first
        resume = ("a hang in the program repeats wherever it runs: the stuck ranks' stacks in "
                  "their logs say where they waited (`python -m hpc_ddp.status RUN_DIR` names them "
                  "and the collective where the ranks parted; docs/troubleshooting.md). Fix that "
                  "first; where a node was at fault (frozen, a stuck filesystem), " + resume)
    return explain(f"the run stopped for {kinds} {times}{since}, more than "
                   f"slurm.{key}={limits[key]}", hint=resume)


def record_next_job(run_dir: Path, attempt: Mapping[str, Any], next_job: str, script: str) -> None:
    """Where Slurm refuses requeue, the batch shell submitted the run's next job itself (a chain):
    the stopped attempt's line says which job comes next (``next_job``) and from which batch script.
    The next attempt is that job's first line; the caps count every line of the chain, as they count
    requeues."""
    append_attempt(run_dir, {**attempt_fields(*attempt_key(attempt)), "amends": True,
                             "next_job": next_job,
                             "chained_with": script, "requeue_by": "chain"})
