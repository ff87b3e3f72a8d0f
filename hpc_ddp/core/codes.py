"""Every exit code and marker the processes of a run tell each other, in one table.

A worker's exit code is how srun, the batch shell (:mod:`hpc_ddp.shell.supervise`) and the rehearsal
(:mod:`hpc_ddp.rehearsal.local`) learn why a step ended, before they read the ledger; the progress
mark is how rank 0 tells the rehearsal its step; and ``status``'s exit codes. No imports (but
:func:`exit_words`'s own, of the stdlib).
"""

from __future__ import annotations

# a bad config, task or environment: the same again on every retry, so never requeued
EXIT_ERROR = 2
EXIT_REQUEUE = 3  # a worker that stopped for a requeue (the local simulation relaunches on it)
EXIT_HUNG = 4  # the hang watchdog ended a rank stuck longer than dist.timeout_s
# a worker refused to start: another job holds the run dir (nothing of that run is touched)
EXIT_LOCKED = 5
# a failure: the program crashed, or a peer's loss ended this rank (settled, capped by max_failures)
EXIT_FAILED = 1
# this rank declared the peer it watches lost (frozen rank or node): the batch shell heals the step
EXIT_LOST = 6
# every rank stopped with a snapshot to leave out a slow node (slurm.straggler.action=replace):
# the batch shell goes on without it, on a spare or fewer nodes (rank/loop/pace.py)
EXIT_SLOW = 7
# the rehearsal: a flag that cannot be rehearsed (--fail-at naming a node it does not have)
EXIT_USAGE = 2
# the rehearsal was interrupted with Ctrl-C (128 + SIGINT, as a shell reports it)
EXIT_INTERRUPTED = 130
# printed by rank 0's worker after every step; the rehearsal reads it
PROGRESS_MARK = "@@hpc_ddp step "
# the rehearsal's injected stops: rank 0 waits for the signal at these steps
HOLD_AT_VAR = "HPC_DDP_LOCAL_HOLD_AT"
# the rehearsal's --fail-at: a rank of the lost node dies after this step
DIE_AT_VAR = "HPC_DDP_LOCAL_DIE_AT"

# What a rank's error says when its collective failed because a peer died (gloo: the peer's sockets
# closed; NCCL: a remote process exited, the communicator aborted): the failure is the peer's.
PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "caused by a remote worker crashing", "remote process exited",
                 "NCCL communicator was aborted")


def blames_a_peer(text: str) -> bool:
    """Whether an error's text is one of :data:`PEER_SYMPTOMS`: the failure is a peer's."""
    return any(symptom in text for symptom in PEER_SYMPTOMS)

# `python -m hpc_ddp.status`'s exit code: what a script that waits on a run needs to know
# (docs/troubleshooting.md)
STATUS_OK = 0  # pending, running, or finished (DONE.json)
# the run failed: its job ended on an error, a crash or a cap of failures (status says why)
STATUS_FAILED = 1
STATUS_USAGE = 2  # not a run directory, or a bad flag
# stopped short of its end (a cap of time-outs or preemptions, a scancel): --resume continues it
STATUS_STOPPED = 3
STATUS_UNKNOWN = 4  # nothing to tell from: no job Slurm knows of and no attempt in the ledger


def exit_words(code: int | None) -> str:
    """One form for a process's end, however it is reported: Python's ``-9`` and a shell's or srun's
    ``137`` are both "killed by SIGKILL (137)"; any other code is "exit code N"."""
    import signal

    number = -code if code is not None and code < 0 else (code - 128 if code is not None
                                                          and 128 < code < 160 else 0)
    try:
        name = signal.Signals(number).name if number else ""
    except ValueError:
        name = ""
    return f"killed by {name} ({128 + number})" if name else f"exit code {code}"
