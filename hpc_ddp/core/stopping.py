"""Stop signals and why a job is stopping: a flag the handlers set, and the reason it means.

Slurm warns a job before its time limit with ``--signal`` (ours: USR2) and, with
``preempt_send_user_signal``, sends the same signal on preemption; a plain cancel or preemption
without it sends SIGTERM. The handlers only record the signal: everything else happens at the next
step boundary, where all ranks agree on the flag. Used by every rank and by the batch shell. No
torch.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable, Mapping


TICK_S = 45  # Slurm checks time limits every 30 s: the warning may come up to that much early

# caught before anything else is imported:
EARLY_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)
# a signal during start-up must not kill the rank before the config names the warning signal (a
# requeued attempt can get Slurm's warning at its first 30 s tick, right as it starts). SIGINT is
# Ctrl-C (the local launcher forwards it; srun does on a second Ctrl-C): an interruption, not a
# preemption.


class StopFlag:
    """Records the first stop signal, and counts them all; the handler does nothing else (it may run
    mid-collective). The count lets a wrapped script's worker tell a later signal (Slurm's SIGTERM
    at the time limit, after the warning it forwarded) from the first."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None
        self.count = 0
        self.last: int | None = None

    def install(self, signums: Iterable[int]) -> None:
        for signum in signums:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.count, self.last = self.count + 1, signum
        if self.signum is None:
            self.signum, self.received_at = signum, time.time()

    @property
    def is_set(self) -> bool:
        return self.signum is not None


def signal_number(name: str) -> int:
    """'USR2' -> signal.SIGUSR2 (the config stores names without the SIG prefix)."""
    return int(getattr(signal, f"SIG{name}"))


def stop_reason(signum: int, warning_signum: int, received_at: float, job_end_time: float | None,
                signal_delay_s: int) -> str:
    """'timeout' when the warning came near the job's original end, else 'preemption'.

    ``job_end_time`` is SLURM_JOB_END_TIME as set when the attempt started (start +
    time limit); a preemption moves the end forward, but not this variable.
    Without it (local simulation) the warning signal means a time-out.
    """
    if signum != warning_signum:
        return "preemption"
    if job_end_time is None:
        return "timeout"
    return "timeout" if received_at >= job_end_time - signal_delay_s - TICK_S else "preemption"


def term_reason(fields: Mapping[str, str], restart_count: int) -> str | None:
    """What a SIGTERM means, from what Slurm says of the job (``scontrol show job``'s fields), not
    from the signal's name. Measured on 22.05 (docs/slurm-local.md): at a preemption the job is
    RUNNING with a PreemptTime until the grace time ends; after it Slurm has requeued the job
    (Restarts > this attempt's restart count) and it looks COMPLETING like a cancel, exactly as
    after an admin's ``scontrol requeue``: both are ``requeued`` (Slurm has requeued the job; nobody
    else may); at the time limit it is COMPLETING with Reason=TimeLimit; on ``scancel`` COMPLETING
    (or CANCELLED) without either. None: RUNNING and not being preempted (a SIGTERM someone sent,
    ``scancel --signal=TERM``), or Slurm could not be asked."""
    state, preempted = fields.get("JobState", ""), fields.get("PreemptTime",
                                                              "None") not in ("None", "Unknown", "")
    if preempted:
        return "preemption"
    if slurm_requeued(fields, restart_count):
        return "requeued"
    if fields.get("Reason") == "TimeLimit" or state == "TIMEOUT":
        return "timeout"
    if state in ("COMPLETING", "CANCELLED"):
        return "cancelled"
    return None


def slurm_requeued(fields: Mapping[str, str], restart_count: int) -> bool:
    """Whether Slurm has already requeued the job: its ``Restarts`` above this attempt's
    ``SLURM_RESTART_COUNT``, or the job REQUEUED or PENDING again (an admin's ``scontrol requeue``,
    a preemption past its grace time). A second ``scontrol requeue`` then fails ("Job is pending
    execution")."""
    restarts = fields.get("Restarts", "")
    return (restarts.isdigit() and int(restarts) > restart_count) or \
        fields.get("JobState", "") in ("REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "PENDING")
