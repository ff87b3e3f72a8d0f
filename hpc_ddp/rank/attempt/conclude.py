"""The end of an attempt on a rank: rank 0 writes its ledger line (finished, interrupted, cancelled,
stopped for a time-out or a preemption, capped), requeues a stopped job (or leaves that to the batch
shell where the tasks have no ``scontrol``), and every rank gets its exit code (:func:`close`, once
the program let go of the run). The writer of the attempt's ledger lines (:func:`ledger_line`,
:func:`amend_line`) for the session, a failure (:mod:`hpc_ddp.rank.attempt.failure`) and a wrapped
script's outcome; only a resume refused at another world size, found below in rank/state/tracked.py,
writes its own.

A stop's line is written at the agreed stop, as soon as its snapshot is committed
(:func:`write_line` from ``run.boundary``), not when the program lets go: what the program does
after ``run.boundary`` returned True (a DataLoader's spawn workers finalising torch took 2-4 s on a
loaded node) would otherwise race Slurm's KillWait after a ``scancel``, and a rank killed then
leaves no line. The requeue waits for
:func:`conclude`, after the program's own teardown: ``scontrol requeue`` ends the job's processes.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any

from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.core.codes import EXIT_REQUEUE
from hpc_ddp.core.errors import first_line
from hpc_ddp.core.slurm_jobs import (AlreadyRequeued, PreemptionError, RequeueRefused, job_fields,
                                     job_spec, requeue,
                                     requeue_available)
from hpc_ddp.core.stopping import signal_number, slurm_requeued, stop_reason, term_reason
from hpc_ddp.rank.attempt.context import Ending
from hpc_ddp.rank.attempt.slow_stop import slow_stop
from hpc_ddp.rank.metrics import timeline
from hpc_ddp.rank.stop.shield import stop_signals_blocked
from hpc_ddp.rank.stop.broken_step import HINT, child_killed, kept_step, pipe_broke
from hpc_ddp.rundir import compile_cache, layout
from hpc_ddp.rundir.ledger import append_attempt, attempt_fields, attempt_key, cap_reached

if TYPE_CHECKING:
    from hpc_ddp.rank.attempt.context import Attempt
    from hpc_ddp.rank.loop.run import Run

log = logging.getLogger("hpc_ddp.session")


SCRIPT_KEPT = ("the script was ended (hpc_ddp commits no snapshot of a train.script: --resume "
               "starts it again, "
               "and it goes on from its own checkpoint, if it saves one)")


def why_stopped(attempt: Attempt) -> str:
    """Rank 0: the stop's reason. A SIGTERM's from what Slurm says of the job now
    (:func:`term_reason`: a preemption, the time limit or a cancel, whatever signal Slurm chose for
    it), recorded beside it in the ledger line; the warning signal's from when it came
    (:func:`stop_reason`)."""
    flag, cfg = attempt.flag, attempt.cfg
    if flag.signum is not None:
        attempt.record["signal"] = signal.Signals(flag.signum).name.removeprefix("SIG")
    if flag.signum == signal.SIGTERM and not attempt.local:
        fields = job_fields(job_spec(attempt.environ), runner=_shielded_run)
        if fields:
            attempt.record["slurm"] = {key: fields[key] for key in ("JobState", "Reason",
                                       "PreemptTime", "Restarts") if key in fields}
        why = term_reason(fields, attempt.env.restart_count)
        if why is not None:
            return why
        # RUNNING and not preempted: someone's `scancel --signal=TERM`, taken for a preemption
        if fields:
            attempt.record["note"] = ("a SIGTERM while the job ran and was not being preempted "
                                      "(scancel "
                                      "--signal=TERM?): taken for a preemption; a plain scancel "
                                      "cancels")
        return "preemption"
    return "preemption" if flag.signum is None else stop_reason(
        flag.signum, signal_number(cfg.slurm.signal), flag.received_at or time.time(),
        attempt.end_time,
        cfg.slurm.signal_delay_s)


def _shielded_run(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` with the stop signals blocked in the child: when a peer leaves first, srun
    ends the step with a SIGTERM to every process in it, scontrol included (rank 0 itself only sets
    its flag); measured on the test cluster, the line then lost what Slurm said of the job."""
    with stop_signals_blocked():
        return subprocess.run(*args, **kwargs)


def conclude(attempt: Attempt, *, stopped: bool, step: int | None) -> int:
    """Rank 0 writes the ledger line (unless :func:`write_line` did at the stop) and requeues a
    stopped job; returns this rank's exit code."""
    ending = attempt.ending = attempt.ending or write_line(attempt, stopped=stopped, step=step)
    if ending.requeue:
        ending.requeue = False
        try:
            # srun's SIGTERM to the step spares it
            requeue(job_spec(attempt.environ), runner=_shielded_run)
        # the batch shell chains the run's next job (hpc_ddp.shell.chain)
        except RequeueRefused as err:
            amend_line(attempt, requeue_by="batch shell", requeue_refused=first_line(err))
            log.warning("Slurm refuses to requeue this job (%s): the batch shell submits the run's "
                        "next job, "
                        "which resumes from this snapshot", first_line(err))
        except PreemptionError as err:
            if not isinstance(err, AlreadyRequeued) and not slurm_requeued(
                    job_fields(job_spec(attempt.environ), runner=_shielded_run),
                    attempt.env.restart_count):
                log.error("%s", err)
            # an admin's `scontrol requeue` (or a preemption's) came first: the job is requeued
            else:
                amend_line(attempt, requeue_by="slurm")
                log.info("Slurm has requeued the job already (%s): the next attempt resumes",
                         first_line(err))
    return ending.code


def write_line(attempt: Attempt, *, stopped: bool, step: int | None) -> Ending:
    """Rank 0 writes the attempt's ledger line; every rank learns its exit code and whether to
    requeue."""
    env, flag, record = attempt.env, attempt.flag, attempt.record
    at = "" if step is None else f" of step {step}"
    kept = SCRIPT_KEPT if attempt.cfg.train.script else f"snapshot{at} committed"
    if not stopped:
        if env.is_main and not attempt.wrapped:
            ledger_line(attempt, "finished")
        return Ending(0)
    if not env.is_main or attempt.wrapped:
        return Ending(EXIT_REQUEUE)
    if flag.signum == signal.SIGINT:  # Ctrl-C
        ledger_line(attempt, "interrupted")
        log.info("interrupted (Ctrl-C): %s, not requeued", kept)
        return Ending(0)
    reason = why_stopped(attempt)
    if reason == "cancelled":
        ledger_line(attempt, "cancelled")
        log.info("the job was cancelled (scancel): %s, not requeued; continue it "
                 "with `python -m hpc_ddp.submit ... --resume`", kept)
        return Ending(0)
    capped = cap_reached(reason, attempt.attempts + [{"reason": reason}], attempt.limits)
    by = requeuer(attempt, reason)
    if by == "slurm":
        record.setdefault("note", "Slurm had requeued the job already when the stop came (an "
                                  "admin's `scontrol "
                          "requeue`, or a preemption past its grace time)")
    ledger_line(attempt, reason, capped=bool(capped), **({} if capped else {"requeue_by": by}))
    if capped:
        log.error("%s", capped)
        return Ending(1)
    why = ("a requeue by Slurm (an admin's `scontrol requeue`, or a preemption past its grace "
           "time)" if reason == "requeued" else reason)
    log.info("stopped%s for %s; %s", "" if step is None else f" at step {step}", why,
             "the script was ended: the next attempt runs it again" if step is None
             else "snapshot committed")
    if by == "batch shell":
        log.warning("scontrol is not on PATH in the job's tasks: the batch shell's settle step "
                    "requeues the job")
    # On preemption too: a job whose tasks exit within the grace time is not requeued by Slurm
    # (measured on 22.05 with PreemptMode=REQUEUE), so rank 0 requeues it like a time-out.
    return Ending(EXIT_REQUEUE, requeue=by == "workers")


def requeuer(attempt: Attempt, reason: str) -> str:
    """Who requeues a stopped job: nobody when Slurm has done it already (``slurm``: an admin's
    ``scontrol requeue``, a preemption past its grace time), else rank 0 (``workers``), or, where
    the tasks have no scontrol (a container started by srun), the batch shell's settle step, which
    runs on the host. The ledger says which, so exactly one does."""
    if attempt.local:
        return "local"
    if reason == "requeued" or slurm_requeued(attempt.record.get("slurm") or {},
                                              attempt.env.restart_count):
        return "slurm"
    return "workers" if requeue_available() else "batch shell"


def ledger_line(attempt: Attempt, reason: str, **fields: Any) -> None:
    """The attempt's ledger line: its common fields (``attempt.record``), how it ended, and
    ``fields``. The one writer of a rank's line; rank 0's alone (its callers check)."""
    append_attempt(attempt.run_dir, {**attempt.record, "reason": reason, **fields})


def amend_line(attempt: Attempt, **fields: Any) -> None:
    """An ``amends`` line: ``fields`` added to the attempt's line that rank 0 wrote already."""
    append_attempt(attempt.run_dir, {**attempt_fields(*attempt_key(attempt.record)), "amends": True,
                                     **fields})


def end_as_stop(attempt: Attempt, run: Run | None, error: BaseException,
                offered: dict[str, Any] | None = None) -> int:
    """After the survivors' snapshot (``attempt.after_failure``, which returned ``offered``): rank
    0 writes the stop's ledger line, and every rank gets the stop's exit code (:func:`conclude`)."""
    saved = kept_step(attempt.run_dir, offered if attempt.env.is_main else None)
    held = run.held.step if run is not None and run.held is not None else None
    # either way a child died: the HINT names the shield
    killed = child_killed(error) or pipe_broke(error)
    attempt.record.update(end=round(time.time(), 3), first_step=(run.resumed_from or 0)
                          if run is not None else 0,
                          last_step=saved, resumed_from=run.resumed_from if run is not None
                          else None,
                          stopped_mid_step={"error": first_line(error), "held": held,
                                            "snapshot": saved,
                                            "child_killed": killed},
                          **timeline.ledger_field(attempt.environ, attempt.attempts,
                                                  attempt.env.in_job))
    lost = ("" if held is None or saved is None or saved >= held
            else f" ({held - saved} step(s) lost)")
    log.error("the stop signal ended this rank's step before the agreed stop: %s. The attempt ends "
              "as the stop "
              "it was (not a failure); its newest snapshot is %s%s.%s", first_line(error),
              f"step {saved}" if saved is not None else "none: it would start over", lost,
              f"\n{HINT}" if killed else "")
    return conclude(attempt, stopped=True, step=saved)


def close(attempt: Attempt, run: Run) -> None:
    """The program let go: the ledger line, the requeue and this rank's exit code, then DONE.json.
    Inside the process group, before its closing barrier: the other ranks leave only after rank 0
    has written the ledger and requeued, so srun's --kill-on-bad-exit cannot cut that short."""
    from hpc_ddp.rank.group import control

    if attempt.ending is None:
        _close_record(attempt, run)
    attempt.code = conclude(attempt, stopped=run.stopped, step=run.step)
    if run.stopped and not attempt.wrapped and attempt.env.world_size > 1:
        # every rank stopped here: each leaves with rank 0's code (0 for a cancel or Ctrl-C, not 3,
        # which srun and sacct would report as a failed step)
        attempt.code = control.from_main(attempt.code)
    if run.finished is not None and not run.stopped and attempt.env.is_main:
        # last, after the ledger line; under train.script the worker publishes it after its own
        target = layout.done_pending if attempt.wrapped else layout.done
        write_atomic(target(attempt.run_dir), json.dumps(run.finished))
        # the empty folder of a run that never compiled
        compile_cache.drop_if_empty(attempt.run_dir)


def _close_record(attempt: Attempt, run: Run) -> None:
    """The attempt's fields for its ledger line; what the loop did that makes a stop impossible or a
    resume inexact (rank/loop/advice.py) goes into its note, and into DONE.json's ``warnings``."""
    from hpc_ddp.rank.loop.advice import outside_iterate
    from hpc_ddp.rank.loop.compiling import compile_report

    attempt.record.update(end=round(time.time(), 3), first_step=run.resumed_from or 0,
                          last_step=run.step,
                          resumed_from=run.resumed_from,
                          **({"resume_read": run.resume_read} if run.resume_read else {}),
                          **timeline.ledger_field(attempt.environ, attempt.attempts,
                                                  attempt.env.in_job),
                          **timeline.compile_field(compile_report()))
    run.advice.add(outside_iterate(run.tracked))
    run.advice.note(attempt.record)
    if run.finished is not None and run.advice.found:
        run.finished["warnings"] = list(run.advice.found)


def line_at_stop(attempt: Attempt, run: Run, step: int) -> None:
    """``run.boundary``'s agreed stop, its snapshot committed: the ledger line now (the module
    docstring says why)."""
    _close_record(attempt, run)
    ending = slow_stop(attempt, run, step, ledger_line)  # rank 0's own stop, for a slow node
    attempt.ending = ending or write_line(attempt, stopped=True, step=step)


def note(attempt: Attempt, text: str) -> None:
    """A note for the ledger line; where rank 0 already wrote it, an ``amends`` line adds the note
    to it."""
    attempt.record["note"] = text
    if attempt.ending is not None and attempt.env.is_main and not attempt.wrapped:
        amend_line(attempt, note=text)


def note_ignored_stop(attempt: Attempt, run: Run) -> None:
    """The loop returned without ever calling run.boundary, or short of ``train.max_steps``: rank 0
    warns once (the ledger's note and DONE.json keep it, :func:`_close_record`). Had a stop signal
    come without a boundary, it could not be acted on: on a cluster the job is killed at the grace
    period's end with nothing saved, and the ledger line and the log say so."""
    if attempt.wrapped:
        return
    if run.boundaries:
        from hpc_ddp.rank.loop.advice import short_of_plan

        run.advice.add(short_of_plan(run.step, attempt.cfg.train))
        return
    if not attempt.flag.is_set:
        # a resumed loop that has nothing left to do makes no boundary, rightly
        if not run.resumed_from:
            from hpc_ddp.rank.loop.advice import NEVER_BOUNDARY

            run.advice.add([NEVER_BOUNDARY])
        return
    name = signal.Signals(attempt.flag.signum).name if attempt.flag.signum else "a stop signal"
    attempt.record["stop_ignored"] = name
    attempt.record["note"] = (f"{name} arrived and was never acted on: the loop never called "
                              "run.boundary(step)")
    log.error("%s arrived and was never acted on: the loop never called run.boundary(step), so it "
              "took no "
              "snapshot and could not stop; on a cluster the job is killed at the end of the grace "
              "period and "
              "everything since the start is lost.\nHINT: call `if run.boundary(step): return` "
              "after every "
              "optimizer step", name)
