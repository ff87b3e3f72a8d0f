"""``python -m hpc_ddp.settle``: after the job step, make sure the attempt is in the ledger.

A rank that is SIGKILLed (by the OOM killer, say) writes nothing, and neither does a
rank that srun kills because another one failed. So the settling is done by the
process that outlives them all: the batch shell (the line after ``srun`` in
the submitit script and in both templates) or the local launcher. It is
idempotent. When the workers recorded how the attempt ended (finished, stopped,
hung, error), nothing is added. Otherwise a ``failed`` line goes in, with the exit
code and how far the run got (:func:`last_known`: the last metrics line or the newest
committed snapshot, and which). A failure or a hang is requeued while
``slurm.max_failures`` allows it; an ``error`` (bad config, task or environment,
exit 2) never is: it would fail the same way after another wait in the queue. A
stop that the workers could not requeue (no ``scontrol`` in the job's tasks,
``requeue_by: batch shell`` in the ledger) is requeued here, once; where Slurm refuses requeue, the
run's next job is submitted here instead (:mod:`hpc_ddp.shell.chain`). No torch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.core.helptext import add_version, for_help
from hpc_ddp.rundir import jit_claims, jit_files, jit_tidy, layout, losses
from hpc_ddp.core.config import load_config
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.codes import EXIT_ERROR
from hpc_ddp.rundir.ledger import (STOP_REASONS, append_attempt, attempt_fields, attempt_key,
                                   attempt_tag, cap_reached, caps, name_the_ledger, note_error,
                                   read_attempts)
from hpc_ddp.core.slurm_jobs import job_fields, job_spec, start_time
from hpc_ddp.shell.chain import batch_shell_requeue
from hpc_ddp.shell.last_known import last_known
from hpc_ddp.shell.replace import replace, safe_heal
from hpc_ddp.core.codes import EXIT_LOCKED
from hpc_ddp.core.mismatch import mismatch_line, mismatch_message
from hpc_ddp.shell.steps import tail_of

FAILURE_REASONS = ("failed", "hung")


def not_requeued(run_dir: Path) -> str:
    return ("not requeued: a configuration, task or environment error fails the same way every "
            "time; the message "
            f"is in the rank logs and in {layout.errors(run_dir)}; fix it, then submit again")


def settle(run_dir: Path, *, job_id: int | None, restart_count: int, exit_code: int,
           limits: Mapping[str, int],
           requeue_job: Callable[[], str | None] | None, now: float | None = None, in_job: int = 0,
           heal: Callable[[Mapping[str, Any]], str | None] | None = None,
           extra: Mapping[str, Any] | None = None, stop_reason: Callable[[], str] | None = None,
           logs: Callable[[], Sequence[Path]] | None = None) -> str:
    """Record the attempt if the workers could not; heal a failure inside the job when ``heal`` can
    (it starts no step itself: it says what the next one will be, or None), else requeue it under
    its cap. ``logs``: the step's output files, read (their tails) only when the workers wrote no
    line: a rank that gloo aborted for a collective mismatch (:mod:`hpc_ddp.core.mismatch`) left no
    line, and the attempt is then an ``error``, never healed nor requeued. Returns what happened."""
    if exit_code == EXIT_LOCKED:
        return "refused to start: another job holds the run dir (its ledger is left alone)"
    if exit_code != 0:
        _seal(run_dir, (job_id, restart_count, in_job))
    with contextlib.suppress(OSError):  # a tidy run dir is worth less than the ledger line
        jit_tidy.prune(run_dir, attempt_tag(job_id, restart_count, in_job))
    if layout.done(run_dir).exists():
        return "finished"
    # the ranks' line of this step may be seconds old, written on another node
    name_the_ledger(run_dir)
    attempts = read_attempts(run_dir)
    mine = [a for a in attempts if attempt_key(a) == (job_id, restart_count, in_job)]
    reason = mine[-1].get("reason") if mine else None
    said = _as_the_workers_said(run_dir, mine[-1], heal, requeue_job) if mine else None
    if said is not None:
        return said
    if not mine and stop_reason is not None and jit_files.broken_stop_marked(run_dir, job_id,
                                                                             restart_count, in_job):
        return _broken_stop(run_dir, stop_reason(), attempts, limits, requeue_job,
                            {**attempt_fields(job_id, restart_count, in_job),
                             "exit_code": exit_code,
                             "end": round(now if now is not None else time.time(), 3),
                             **last_known(run_dir),
                             **(extra or {})})
    mismatch = None if mine or exit_code in (0,
                                             EXIT_ERROR) or logs is None else _mismatch_in(logs())
    if mine:
        record: dict[str, Any] = mine[-1]
        if reason == "hung":
            record = _amend_hung(run_dir, (job_id, restart_count, in_job), record)
    else:
        record = _failed_record(run_dir, (job_id, restart_count, in_job), exit_code, mismatch, now,
                                extra)
        # durable before anything else runs: a healer that fails cannot lose it
        append_attempt(run_dir, record)
        if mismatch:
            # the whole message, HINT too, where a rank's error is kept
            note_error(run_dir, record, mismatch)
            return f"error: a collective mismatch, a bug of the program; {not_requeued(run_dir)}"
        if record["reason"] == "error":
            return f"error; {not_requeued(run_dir)}"
        attempts = attempts + [record]
    return _heal_or_requeue(run_dir, (job_id, restart_count, in_job), record, attempts,
                            recorded_by_workers=bool(mine), limits=limits, heal=heal,
                            requeue_job=requeue_job)


def _as_the_workers_said(run_dir: Path, line: Mapping[str, Any],
                         heal: Callable[[Mapping[str, Any]], str | None] | None,
                         requeue_job: Callable[[], str | None] | None) -> str | None:
    """What a line the workers wrote settles by itself (None: a failure or a hang, healed or
    requeued below)."""
    reason = line.get("reason")
    if reason == "error":
        return f"error; {not_requeued(run_dir)}"
    if reason in STOP_REASONS and line.get("requeue_by") == "batch shell":
        return _requeue_stop(reason, requeue_job)
    if reason == "slow":  # a planned stop to leave out a slow node (rank/attempt/slow_stop.py)
        return replace(line, heal, requeue_job)
    if reason not in FAILURE_REASONS:
        return f"recorded by the workers: {reason}"
    return None


def _amend_hung(run_dir: Path, key: tuple[int | None, int, int],
                record: dict[str, Any]) -> dict[str, Any]:
    """A ``hung`` line is rank 0's, written as its watchdog fired: it knew neither how far the run
    got (status showed "-" for its steps) nor the survivors' snapshot another survivor committed
    after it (it kept "no survivors' snapshot"). Now that the step has ended and is sealed, both
    are read and added in an amending line (issue 57)."""
    found: dict[str, Any] = {} if isinstance(record.get("last_step"), int) else last_known(run_dir)
    saved = losses.jit_fields(run_dir, *key)
    if "jit_snapshot" in saved:
        found.update(jit_snapshot=saved["jit_snapshot"], jit_fallback=None)
    if not found:
        return record
    append_attempt(run_dir, {**attempt_fields(*key), "amends": True, **found})
    return {**record, **found}


def _seal(run_dir: Path, key: tuple[int | None, int, int]) -> None:
    """Fencing (``key``: job id, requeue, job step): no process of this attempt commits a
    survivors' snapshot from now on."""
    try:
        jit_claims.seal(jit_files.folder(run_dir, *key))
    except OSError as err:  # the ledger line matters more: recorded below whatever the seal met
        print(f"hpc_ddp.settle: could not seal the attempt's survivors' snapshot: {err}",
              file=sys.stderr)


def _heal_or_requeue(run_dir: Path, key: tuple[int | None, int, int], record: Mapping[str, Any],
                     attempts: list[dict[str, Any]], *, recorded_by_workers: bool,
                     limits: Mapping[str, int],
                     heal: Callable[[Mapping[str, Any]], str | None] | None,
                     requeue_job: Callable[[], str | None] | None) -> str:
    """A failure or a hang in the ledger: heal it inside the job, else requeue it under its cap
    (what was decided goes in the ledger as an amending line)."""
    healing, problem = safe_heal(heal, record)
    if healing:
        return f"{record['reason']}; {healing}"
    capped = cap_reached(record["reason"], attempts, limits)
    decided = {**({} if recorded_by_workers else {"capped": bool(capped)}),
               **({"heal_error": problem} if problem else {})}
    if decided:
        append_attempt(run_dir, {**attempt_fields(*key), "amends": True, **decided})
    if capped or requeue_job is None:
        return f"{record['reason']}; not requeued" + (f": {capped}" if capped else "")
    done = requeue_job()
    return f"{record['reason']}; {done or 'requeued'} (slurm.max_failures allows it)"


def _requeue_stop(reason: str, requeue_job: Callable[[], str | None] | None) -> str:
    """A stop the workers recorded but left to the batch shell to requeue: requeue it, once."""
    if requeue_job is None:
        return (f"{reason}; the workers could not requeue and neither can the batch shell "
                "(no job id)")
    # the workers left it to us: exactly one requeue (or, where Slurm refuses, a chain)
    done = requeue_job()
    if done and done != "requeued":
        return f"{reason}; {done}"
    return f"{reason}; requeued by the batch shell (the job's tasks have no scontrol)"


def _failed_record(run_dir: Path, key: tuple[int | None, int, int], exit_code: int,
                   mismatch: str | None,
                   now: float | None, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ledger line of a step whose workers wrote none (``key``: job id, requeue, job step)."""
    job_id, restart_count, in_job = key
    return {**attempt_fields(job_id, restart_count, in_job), "exit_code": exit_code,
            "reason": "error" if exit_code == EXIT_ERROR or mismatch else "failed",
            **({"message": mismatch.splitlines()[0]} if mismatch else {}),
            "end": round(now if now is not None else time.time(), 3), **last_known(run_dir),
            **losses.jit_fields(run_dir, job_id, restart_count, in_job), **(extra or {})}


# of each log: the abort is among the last lines a rank wrote, the survivors' after it
TAIL_BYTES = 65536


def _mismatch_in(paths: Sequence[Path]) -> str | None:
    """The error for a collective mismatch that one of the step's logs shows in its tail (its first
    such line, naming the file), or None."""
    for path in paths:
        tail = tail_of(path, TAIL_BYTES)
        if tail is None:
            continue
        line = mismatch_line(tail.decode(errors="replace").splitlines())
        if line is not None:
            return mismatch_message(line, str(path))
    return None


def _broken_stop(run_dir: Path, reason: str, attempts: list[dict[str, Any]],
                 limits: Mapping[str, int],
                 requeue_job: Callable[[], str | None] | None, record: dict[str, Any]) -> str:
    """A stop signal broke the step (a rank marked it) and rank 0 wrote no line (killed at the end
    of the grace time, say): the attempt is that stop, never a failure to heal; requeued unless it
    was a cancel."""
    capped = reason in STOP_REASONS and cap_reached(reason, attempts + [{"reason": reason}], limits)
    append_attempt(run_dir, {**record, "reason": reason, "capped": bool(capped),
                             "note": "a stop signal broke the step and the ranks wrote no line: "
                                     "recorded by the batch "
                             "shell"})
    if reason == "requeued":
        return ("requeued by Slurm (an admin's scontrol requeue, or a preemption past its grace "
                "time)")
    if reason not in STOP_REASONS or capped or requeue_job is None:
        return f"{reason} (a stop signal broke the step); not requeued" + (f": {capped}" if capped
                                                                           else "")
    done = requeue_job()
    return f"{reason} (a stop signal broke the step); {done or 'requeued'} by the batch shell"


def limits_of(config_path: Path) -> tuple[Path, dict[str, int]]:
    cfg = load_config([config_path])
    return Path(cfg.run_dir), caps(cfg.slurm)


def pick_config(configs: list[str], environ: Mapping[str, str]) -> str:
    """The config of this job, or of this array element (SLURM_ARRAY_TASK_ID indexes the list)."""
    if len(configs) == 1:
        return configs[0]
    index = int(environ.get("SLURM_ARRAY_TASK_ID", "-1"))
    if not 0 <= index < len(configs):
        raise HpcDdpError(f"SLURM_ARRAY_TASK_ID={environ.get('SLURM_ARRAY_TASK_ID')} does not "
                          "index the "
                          f"{len(configs)} configs given", key="SLURM_ARRAY_TASK_ID")
    return configs[index]


def _start(spec: str) -> dict[str, float]:
    """The attempt's start as Slurm says (the step ran before this line): status sums attempts that
    have one."""
    start = start_time(job_fields(spec)) if spec else None
    return {"start": round(start, 3)} if start else {}


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.settle", description=for_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example (the line after srun in a batch script):\n"
                                     "  python -m hpc_ddp.settle --exit-code $? "
                                     "runs/mlp/config.yaml")
    add_version(parser)
    parser.add_argument("--exit-code", type=int, required=True, help="srun's exit code ($?)")
    parser.add_argument("configs", nargs="+", help="the run's config.yaml (one per array element, "
                                                   "in order)")
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    try:
        run_dir, limits = limits_of(Path(pick_config(args.configs, environ)))
        job = environ.get("SLURM_JOB_ID", "")
        spec = job_spec(environ)
        outcome = settle(run_dir, job_id=int(job) if job.isdigit() else None,
                         restart_count=int(environ.get("SLURM_RESTART_COUNT", "0") or 0),
                         exit_code=args.exit_code,
                         limits=limits, requeue_job=batch_shell_requeue(
                             run_dir, (int(job) if job.isdigit() else None,
                                       int(environ.get("SLURM_RESTART_COUNT", "0") or 0), 0), spec,
                                       environ)
                         if spec else None, extra=_start(spec))
    except HpcDdpError as err:
        print(f"hpc_ddp.shell.settle: error: {err}", file=sys.stderr)
        return args.exit_code or 1
    print(f"hpc_ddp.shell.settle: attempt {environ.get('SLURM_RESTART_COUNT', '0')} of job "
          f"{spec or '-'}: {outcome}",
          file=sys.stderr)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
