"""One failure handler per process, bounded in time, whatever thread starts it (issue 44): the
survivors' snapshot (:func:`hpc_ddp.rank.salvage.jit.after_failure`) written once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hpc_ddp.jit")
# how long a second failure handler waits for the first one's write (under KillWait)
HANDLER_WAIT_S = 25.0


class OneHandler:
    """:func:`after_failure` once per process, whichever thread comes first (issue 44).

    The training thread (its collective failed), the liveness thread (a frozen peer, a declaration)
    and the watchdog thread (a hang) may each start the survivors' snapshot, and the second used to
    write the same files over the first (and a thread that exits after it cut the first write
    short). The first caller writes; a later one waits for it, up to ``wait_s`` (under Slurm's
    KillWait, 30 s by default), and returns what it did, so that whichever thread ends the process
    ends it after the write.

    A side thread passes ``wait_s`` for its own call too: its write then runs in a thread of its
    own, and the side thread goes on to exit when the bound passes, whatever the write waits for (on
    a GPU, a read of the state queues behind a wedged collective's kernel). The training thread's
    own write runs inline, as long as it takes."""

    def __init__(self, handler: Callable[[BaseException], dict[str, Any] | None],
                 wait_s: float = HANDLER_WAIT_S) -> None:
        self.handler, self.wait_s = handler, wait_s
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False
        self._result: dict[str, Any] | None = None

    def __call__(self, error: BaseException, wait_s: float | None = None) -> dict[str, Any] | None:
        with self._lock:
            first, self._started = not self._started, True
        if first and wait_s is None:
            self._run(error)
            return self._result
        if first:
            threading.Thread(target=self._run, args=(error,), name="hpc_ddp-failure",
                             daemon=True).start()
        limit = wait_s if wait_s is not None else self.wait_s
        if not self._done.wait(limit):
            log.warning("the survivors' snapshot of this rank did not end within %g s: this rank "
                        "exits without it", limit)
        return self._result

    def _run(self, error: BaseException) -> None:
        try:
            self._result = self.handler(error)
        finally:
            self._done.set()
