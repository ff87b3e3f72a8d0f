"""A child process's death is acted on at a step boundary, not wherever the rank happens to be
(issue 43).

PyTorch's DataLoader installs a SIGCHLD handler that raises ``DataLoader worker (pid ...) is killed
by signal`` in the rank's main thread as soon as a worker dies: in the middle of
``optimizer.step()`` as readily as between steps. Slurm signals every process of a step, so a stop
signal that kills an unshielded worker (:mod:`hpc_ddp.rank.stop.shield`) used to raise mid-update,
where the rank holds no whole step and the survivors' snapshot falls back to the last periodic one.

From the first boundary on, the rank's SIGCHLD handler only notes the death (handlers only set a
flag); PyTorch's own handler, kept aside, runs at the next ``run.boundary``, where the rank holds
the step it just finished whole:

- no stop signal: PyTorch's error is raised there (a crashed worker is a failure; the survivors'
  snapshot then has this step);
- a stop signal arrived (or arrives within a moment: the child is often signalled first): the death
  is the stop's doing and is passed over; the batches already prefetched carry the loop to the
  boundary where every rank agrees to stop, and a fetch that finds the workers gone raises at the
  top of a step, which
  :mod:`hpc_ddp.rank.stop.broken_step` ends as the stop it was.

The loader itself still notices a dead worker when it has no batch left for 5 s (PyTorch's own
check).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from hpc_ddp.core.stopping import StopFlag

Handler = Callable[[int, Any], Any]


class ChildDeaths:
    """Holds the SIGCHLD handler in force (PyTorch's, once a loader has started workers) until a
    boundary."""

    def __init__(self, flag: StopFlag | None,
                 stop_came_first: Callable[[StopFlag, BaseException], bool]) -> None:
        self.flag, self.stop_came_first = flag, stop_came_first
        self.held: Handler | None = None  # the handler this one stands in for
        self.pending = False

    def _noted(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True

    def at_boundary(self) -> None:
        """Run the held handler for a death noted since the last boundary (it raises for a dead
        loader worker) unless a stop signal explains the death; then stand in for whatever handler
        is in force now."""
        if self.pending:
            self.pending = False
            if self.held is not None:
                try:
                    self.held(signal.SIGCHLD, None)
                except Exception as err:
                    if self.flag is None or not self.stop_came_first(self.flag, err):
                        raise
        self._stand_in()

    def _stand_in(self) -> None:
        current = signal.getsignal(signal.SIGCHLD)
        if (current == self._noted or not callable(current)
                or threading.current_thread() is not threading.main_thread()):
            return
        self.held = current
        signal.signal(signal.SIGCHLD, self._noted)
