"""Whether a process of this machine lives: one answer for every place that asks (the run lock's
holder, a rank of the node at its failure path, the rehearsal's warm process, the local cluster's
daemons). Pure reads of the kernel's process table; no torch, no environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def exists(pid: int) -> bool:
    """``pid`` is in the process table (another user's counts: kill(2) answers EPERM for it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def zombie(pid: int) -> bool:
    """An exited process not yet reaped (state Z): dead, though kill(pid, 0) still finds it. A
    killed launcher's ranks go to PID 1, which reaps slowly on some machines (containers)."""
    found = seen(pid)
    return found is not None and found.letter == "Z"


def running(pid: int) -> bool:
    """``pid`` exists and has not exited."""
    return exists(pid) and not zombie(pid)


@dataclass(frozen=True)
class Seen:
    """One look at a process in the kernel's table (``/proc/PID/stat``): its state letter (R, S, D:
    alive; T: stopped by a signal; t: stopped by a debugger; Z, X: exited) and when it started
    (clock ticks after boot: a pid the kernel gave to another process starts at another time)."""

    letter: str
    started: int

    @property
    def exited(self) -> bool:
        return self.letter in ("Z", "X", "x")

    @property
    def stopped(self) -> bool:
        """Stopped by SIGSTOP (or a terminal's SIGTSTP): the state a frozen rank is in. A debugger's
        stop (``t``: gdb, py-spy) is someone looking at it, not a loss."""
        return self.letter == "T"


def seen(pid: int, proc: Path = Path("/proc")) -> Seen | None:
    """``pid`` as the kernel shows it now; None when it is not in the table (or ``proc`` is not a
    Linux process table). ``proc``: the seam for tests."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return Seen(fields[0], int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None
