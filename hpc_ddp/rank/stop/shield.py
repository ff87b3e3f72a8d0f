"""Data-loader workers outlive a stop signal, so the rank can take its stop snapshot (issue 43).

Slurm signals every process of a job step, not just the ranks: on ``scancel``, a preemption or the
time-limit warning, a rank's DataLoader workers get the same SIGTERM (or warning signal) as the
rank. PyTorch's worker dies of a SIGTERM that its parent did not send, and a spawned worker dies of
SIGUSR2 (the default action); the rank then raises ``DataLoader worker (pid ...) is killed by
signal`` one step before the boundary where every rank agrees to stop, and the stop snapshot is
never written.

So a shielded worker ignores the stop signals (SIGTERM, SIGINT, SIGUSR2 and ``slurm.signal``):

- :func:`worker_init` is the ``worker_init_fn`` to pass to a DataLoader (our Trainer passes it; an
  own loop passes ``hpc_ddp.worker_init()`` or ``hpc_ddp.worker_init(its_own_fn)``). It works for
  the fork, forkserver and spawn contexts: the function runs in the worker, after PyTorch set its
  handlers.
- A forkserver is shielded too (:data:`FORKSERVER_PRELOAD`, which the session adds to the server's
  preload list): a forkserver's workers take the server for their parent and exit when it dies.
- A shielded worker still ends when the rank does: the rank kills its daemonic children before it
  leaves (:func:`hpc_ddp.core.shutdown.exit_fast`), and an interpreter that exits normally kills
  them first (:func:`kill_daemonic_children`, registered at exit), where multiprocessing would send
  them a SIGTERM they ignore and then wait for them forever.

Why not block the signals in every child instead (a signal mask is inherited through fork and exec)?
It would also reach children that must obey SIGTERM: ``multiprocessing.Pool.terminate()`` (``with
Pool() as p:``) and torch.compile's worker pool would wait for ever. A worker init names exactly the
processes it shields. No torch here (the forkserver imports this module before torch).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from hpc_ddp.core.errors import UsageError, explain
from hpc_ddp.core.shutdown import kill_daemonic_children

# set by the session: the run's warning signal, for the children
STOP_SIGNALS_VAR = "HPC_DDP_STOP_SIGNALS"
# imported by the forkserver alone: it shields itself
FORKSERVER_PRELOAD = "hpc_ddp.rank.stop.forkserver"
BASE_SIGNALS = ("TERM", "INT", "USR2")
_registered = False


def stop_signals(environ: Mapping[str, str]) -> list[int]:
    """The signals a stop arrives by: SIGTERM, SIGINT, SIGUSR2 and the run's ``slurm.signal`` (in
    ``environ``)."""
    names = [*BASE_SIGNALS, *(n for n in environ.get(STOP_SIGNALS_VAR, "").split(",") if n)]
    found = {getattr(signal, f"SIG{name.upper().removeprefix('SIG')}", None) for name in names}
    return sorted(int(s) for s in found if s is not None
                  and s not in (signal.SIGKILL, signal.SIGSTOP))


def shield(environ: Mapping[str, str] | None = None) -> None:
    """Ignore the stop signals in this process (call it in the child's main thread)."""
    for signum in stop_signals(os.environ if environ is None else environ):
        signal.signal(signum, signal.SIG_IGN)


class WorkerInit:
    """A picklable ``worker_init_fn`` (spawn and forkserver workers unpickle it): shield, then the
    user's own."""

    def __init__(self, then: Callable[[int], object] | None = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        shield()
        if self.then is not None:
            self.then(worker_id)

    def __repr__(self) -> str:
        return (f"hpc_ddp.worker_init({self.then!r})" if self.then is not None
                else "hpc_ddp.worker_init()")


def worker_init(then: Callable[[int], object] | None = None) -> WorkerInit:
    """``DataLoader(..., worker_init_fn=hpc_ddp.worker_init())``: the workers ignore the stop
    signals, so a ``scancel``, a preemption or the time-limit warning reaches the rank alone and the
    rank stops at its next boundary with a snapshot. ``then``: your own
    ``worker_init_fn(worker_id)``, called after (it must be picklable for the spawn and forkserver
    contexts: a module-level function). Passed uncalled (``worker_init_fn=hpc_ddp.worker_init``), it
    shields the worker all the same inside a run (whose session kills the shielded workers when the
    rank leaves), and is a usage error naming the fix elsewhere."""
    # called by the loader as the worker_init_fn itself
    if isinstance(then, int) and not isinstance(then, bool):
        # no hpc_ddp session started this worker's rank (module docstring)
        if STOP_SIGNALS_VAR not in os.environ:
            raise UsageError(explain(
                "DataLoader(worker_init_fn=hpc_ddp.worker_init) passes the function itself, "
                "outside an hpc_ddp run",
                expected="worker_init_fn=hpc_ddp.worker_init() (called): it also makes the process "
                         "kill its "
                "shielded workers at exit, which would otherwise wait for them for ever",
                hint="add the parentheses: worker_init_fn=hpc_ddp.worker_init(), or "
                     "hpc_ddp.worker_init(your_fn)"))
        shield()  # in a rank of a run: its session kills the shielded workers when it leaves
        return WorkerInit()
    at_exit_kill_workers()  # in the rank, when the loader is built
    return WorkerInit(then)


def at_exit_kill_workers() -> None:
    """Once per process (the session calls it in every rank): at a normal interpreter exit, SIGKILL
    the daemonic children first (a shielded worker ignores the SIGTERM multiprocessing would
    send)."""
    global _registered
    if not _registered:
        atexit.register(kill_daemonic_children)
        _start_resource_tracker()
        _registered = True


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """The stop signals blocked in this thread while a helper process starts inside (a signal mask
    is inherited through fork and exec): it never receives them, as Slurm sends them to every
    process of the step. For helpers that must outlive the stop: W&B's service process (its run is
    finished after the stop snapshot), multiprocessing's resource tracker. Signals that arrive
    meanwhile reach this thread when it leaves. Main thread only (elsewhere nothing is blocked)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals(os.environ))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (spawn and forkserver loaders need one) with the
    stop signals blocked, as it already starts with SIGINT and SIGTERM: a warning signal would kill
    it, and its replacement prints a traceback for every queue the loader frees."""
    from multiprocessing import resource_tracker

    with stop_signals_blocked():
        resource_tracker.ensure_running()


class _Hook:
    """What :func:`multiprocessing.util.register_after_fork` keys its hook on (a weak reference:
    kept here)."""


_AFTER_FORK = _Hook()


def release_alive_pipe(_hook: object = None) -> bool:
    """In a child of a forkserver: close its copy of the server's "alive" pipe; True when one was
    closed.

    A forkserver exits when every write end of that pipe is closed, which is meant to be when its
    rank (its client) has died. But multiprocessing hands each child of the server a write end too
    (``_serve_one``), so that a child could ask the same server for processes; it never does (a
    forkserver's child that starts processes of its own starts a server of its own, as
    ``_forkserver_pid`` is unset there). So after a rank killed with SIGKILL, its loader workers
    keep the server alive and the server keeps them alive (PyTorch's worker ends when its parent
    changes): a pair of orphans that ignore SIGTERM, ~100 MB each, for ever, on a cluster that
    tracks a step's processes by parent (``proctrack/linuxproc``, ``pgid``) and in the local
    cluster. With the pipe released, the server exits with its rank, and the workers a moment later
    (PyTorch's watchdog polls every 5 s). Reads CPython's private forkserver state, guarded: if a
    future Python moves it, nothing is closed (a test pins the behaviour)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if server is None or fd is None or getattr(server, "_forkserver_pid", 0) is not None:
        # not a forkserver's child (a process that started a server holds its own end on purpose)
        return False
    try:
        os.close(fd)
    except OSError:
        pass
    server._forkserver_alive_fd = None
    return True


def release_alive_pipe_in_children() -> None:
    """In a forkserver (its preload): every child it forks runs :func:`release_alive_pipe` before
    its target, a DataLoader worker with or without :func:`worker_init` alike (multiprocessing runs
    its after-fork hooks in each new process once the server has handed it its pipes)."""
    from multiprocessing import util

    util.register_after_fork(_AFTER_FORK, release_alive_pipe)


def ignores(pid: int, signum: int, proc: Path = Path("/proc")) -> bool | None:
    """Whether process ``pid`` ignores ``signum`` (its ``SigIgn`` mask in /proc), or None when
    unknown."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def unshielded_workers(environ: Mapping[str, str] | None = None) -> list[int]:
    """The pids of this process's daemonic children (DataLoader workers) that a stop signal would
    kill now. (A forkserver's child ignores the stop signals from birth, as the server does, until
    PyTorch's worker sets its own SIGTERM handler a moment before the worker_init_fn runs.)"""
    signums = stop_signals(os.environ if environ is None else environ)
    return sorted(child.pid for child in multiprocessing.active_children()
                  if child.daemon and child.pid is not None
                  and any(ignores(child.pid, s) is False for s in signums))
