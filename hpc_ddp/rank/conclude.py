"""The end of an attempt on a rank: rank 0 writes its ledger line (finished, interrupted, cancelled,
stopped for a time-out or a preemption, capped), requeues a stopped job (or leaves that to the batch
shell where the tasks have no ``scontrol``), and every rank gets its exit code.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING

from hpc_ddp.core.codes import EXIT_REQUEUE
from hpc_ddp.core.slurm_jobs import PreemptionError, job_fields, job_spec, requeue, requeue_available
from hpc_ddp.core.stopping import signal_number, stop_reason, term_reason
from hpc_ddp.rundir.ledger import append_attempt, cap_reached

if TYPE_CHECKING:
    from hpc_ddp.rank.session import Attempt

log = logging.getLogger("hpc_ddp.session")


def why_stopped(attempt: Attempt) -> str:
    """Rank 0: the stop's reason. A SIGTERM's from what Slurm says of the job now (:func:`term_reason`: a
    preemption, the time limit or a cancel, whatever signal Slurm chose for it), recorded beside it in the
    ledger line; the warning signal's from when it came (:func:`stop_reason`)."""
    flag, cfg = attempt.flag, attempt.cfg
    if flag.signum is not None:
        attempt.record["signal"] = signal.Signals(flag.signum).name.removeprefix("SIG")
    if flag.signum == signal.SIGTERM and not attempt.local:
        fields = job_fields(job_spec(attempt.environ))
        if fields:
            attempt.record["slurm"] = {key: fields[key] for key in ("JobState", "Reason", "PreemptTime", "Restarts")
                                       if key in fields}
        why = term_reason(fields, attempt.env.restart_count)
        if why is not None:
            return why
        if fields:  # RUNNING and not preempted: someone's `scancel --signal=TERM`, taken for a preemption
            attempt.record["note"] = ("a SIGTERM while the job ran and was not being preempted (scancel "
                                      "--signal=TERM?): taken for a preemption; a plain scancel cancels")
        return "preemption"
    return "preemption" if flag.signum is None else stop_reason(
        flag.signum, signal_number(cfg.slurm.signal), flag.received_at or time.time(), attempt.end_time,
        cfg.slurm.signal_delay_s)


def conclude(attempt: Attempt, *, stopped: bool, step: int | None) -> int:
    """Rank 0 writes the ledger line and requeues a stopped job; returns this rank's exit code."""
    env, flag, record, run_dir = attempt.env, attempt.flag, attempt.record, attempt.run_dir
    at = "" if step is None else f" of step {step}"
    if not stopped:
        if env.is_main and not attempt.wrapped:
            append_attempt(run_dir, {**record, "reason": "finished"})
        return 0
    if not env.is_main or attempt.wrapped:
        return EXIT_REQUEUE
    if flag.signum == signal.SIGINT:
        append_attempt(run_dir, {**record, "reason": "interrupted"})
        log.info("interrupted (Ctrl-C): snapshot%s committed, not requeued", at)
        return 0
    reason = why_stopped(attempt)
    if reason == "cancelled":
        append_attempt(run_dir, {**record, "reason": "cancelled"})
        log.info("the job was cancelled (scancel): snapshot%s committed, not requeued; continue it "
                 "with `python -m hpc_ddp.submit ... --resume`", at)
        return 0
    capped = cap_reached(reason, attempt.attempts + [{"reason": reason}], attempt.limits)
    # Who requeues: rank 0, or (where the tasks have no scontrol, e.g. a container started by srun)
    # the batch shell's settle step, which runs on the host. The ledger says which, so exactly one does.
    by = "local" if attempt.local else "workers" if requeue_available() else "batch shell"
    append_attempt(run_dir, {**record, "reason": reason, "capped": bool(capped),
                             **({} if capped else {"requeue_by": by})})
    if capped:
        log.error("%s", capped)
        return 1
    log.info("stopped%s for %s; %s", "" if step is None else f" at step {step}", reason,
             "the script was ended: the next attempt runs it again" if step is None else "snapshot committed")
    if by == "batch shell":
        log.warning("scontrol is not on PATH in the job's tasks: the batch shell's settle step requeues the job")
    elif by == "workers":
        # On preemption too: a job whose tasks exit within the grace time is not requeued by Slurm
        # (measured on 22.05 with PreemptMode=REQUEUE), so rank 0 requeues it like a time-out.
        try:
            requeue(job_spec(attempt.environ))
        except PreemptionError as err:
            log.error("%s", err)
    return EXIT_REQUEUE
