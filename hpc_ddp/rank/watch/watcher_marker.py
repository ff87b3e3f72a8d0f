"""The node's watcher's marker on the node's storage: that it runs (its pid), and where it answers
pings (its endpoint, for the store's hand-over: :mod:`hpc_ddp.rank.watch.net_exchange`). The node's
ranks read it to know whether the watcher is on duty (:func:`watching`). No torch."""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.core import processes
from hpc_ddp.rundir import beats


def marker(folder: Path) -> Path:
    """Where the node's watcher says it runs (its pid), on the node's storage."""
    return folder / "watcher.beat"


def watching(folder: Path, local_tag: str, proc: Path = Path("/proc")) -> bool:
    """The node's watcher runs and is not stopped: the node's ranks leave their node's ranks to it
    (a thread's watch of a rank's beats cries wolf when that rank holds the GIL)."""
    found = beats.read(marker(folder), local_tag, own=True)
    process = None if found is None or found.pid is None else processes.seen(found.pid, proc)
    return process is not None and not process.exited and not process.stopped
