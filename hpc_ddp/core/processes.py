"""Whether a process of this machine lives: one answer for every place that asks (the run lock's
holder, a rank of the node at its failure path, the rehearsal's warm process, the local cluster's
daemons). Pure reads of the kernel's process table; no torch, no environment."""

from __future__ import annotations

import os
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
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def running(pid: int) -> bool:
    """``pid`` exists and has not exited."""
    return exists(pid) and not zombie(pid)
