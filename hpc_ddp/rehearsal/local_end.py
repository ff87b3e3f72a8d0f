"""The ranks of one rehearsal attempt as a group: wait until they have all exited or one has
failed (Ctrl-C passed on as SIGINT), then end what is left, as srun ends a step's tasks.

Apart from :mod:`hpc_ddp.rehearsal.local`, which builds and starts the attempt, because this is
only about processes and signals: it knows nothing of the run but whether a survivor still writes
its just-in-time snapshot (``writing``). No torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import IO

from hpc_ddp.core.codes import EXIT_REQUEUE
from hpc_ddp.rehearsal.local_inject import signal_family

POLL_S = 0.02
GRACE_S = 3.0
# Slurm's default KillWait: how long a survivor's just-in-time snapshot may take after SIGTERM
KILL_WAIT_S = 30.0


def wait_ranks(procs: list[subprocess.Popen[bytes]],
               err: IO[str]) -> tuple[list[int | None], list[int], bool]:
    """Until every rank has exited or one has failed: (exit codes, failed ranks, interrupted with
    Ctrl-C)."""
    interrupted = False
    while True:
        try:
            codes = [p.poll() for p in procs]
            failed = [rank for rank, code in enumerate(codes)
                      if code not in (None, 0, EXIT_REQUEUE)]
            if failed or all(code is not None for code in codes):
                return codes, [] if interrupted else failed, interrupted
            time.sleep(POLL_S)
        except KeyboardInterrupt:
            if interrupted:  # the second Ctrl-C: no more waiting for the snapshot
                err.write("[local] interrupted again: ending every rank now\n")
                return [p.poll() for p in procs], [], True
            interrupted = True
            err.write("[local] Ctrl-C: every rank stops at its next step boundary and commits a "
                      "snapshot "
                      "(Ctrl-C again ends them at once)\n")
            for proc in procs:
                if proc.poll() is None:
                    # as a terminal's Ctrl-C reaches the loader workers too
                    signal_family(proc.pid, signal.SIGINT)


def end_ranks(procs: list[subprocess.Popen[bytes]], frozen: Sequence[int] = (),
              writing: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after a grace period (up to srun's
    KillWait while a survivor still writes its just-in-time snapshot: ``writing``); the ``frozen``
    ranks' at once (a stopped process never acts on SIGTERM; their scripts die with them:
    PR_SET_PDEATHSIG)."""
    for rank in frozen:
        if procs[rank].poll() is None:
            try:
                os.killpg(procs[rank].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        start = time.monotonic()
        while any(p.poll() is None for p in procs) and (time.monotonic() < start + GRACE_S or (
                sig == signal.SIGTERM and time.monotonic() < start + KILL_WAIT_S and writing())):
            time.sleep(POLL_S)
    for proc in procs:  # what a rank that died first left in its group (its node's watcher) ends
        try:  # with the step, as srun's cgroup ends every process of it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
