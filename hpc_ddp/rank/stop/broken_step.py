"""A stop whose last step broke: the program raised after a stop signal had reached this rank (issue
43).

Slurm signals every process of the step. A child the stop signal kills (a DataLoader worker not
shielded with :func:`hpc_ddp.worker_init`, a forkserver, a helper process of the user's) makes the
rank raise during the step before the boundary where every rank would have agreed to stop; a peer's
collective then fails as that rank leaves. Neither is a failure of the run: the attempt ends as the
stop it was (``cancelled``, ``preemption``, ``timeout``, ``interrupted``), with its ledger line, the
survivors' snapshot of the step every rank held at its last boundary
(:mod:`hpc_ddp.rank.salvage.jit`, written from the run dir without the training group), and no
in-job restart used up. What it cost (the step in flight, or back to the last periodic snapshot when
no whole step could be written) and the error are in the ledger line.

This module tells the stop from a failure (:func:`stop_came_first`: noticing); the attempt's end as
that stop is :func:`hpc_ddp.rank.attempt.conclude.end_as_stop`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hpc_ddp.core.codes import blames_a_peer
from hpc_ddp.core.stopping import StopFlag
from hpc_ddp.rundir import jit_files, newest, snapshot

if TYPE_CHECKING:
    from hpc_ddp.core.slurm_env import DistEnv

log = logging.getLogger("hpc_ddp.session")
# a child killed by the stop signal may be noticed before this rank's own signal arrives
SIGNAL_WAIT_S = 2.0
# how long rank 0 waits for another node to commit the split snapshot its own share was part of
# (under the local cluster's KillWait of 5 s, after SIGNAL_WAIT_S)
COMMIT_WAIT_S = 2.0
CHILD_DEATHS = ("DataLoader worker", "killed by signal", "exited unexpectedly")
HINT = ("HINT: pass worker_init_fn=hpc_ddp.worker_init() to every DataLoader with workers (your "
        "own "
        "worker_init_fn goes inside: hpc_ddp.worker_init(fn)); the workers then ignore the stop "
        "signals and the "
        "rank stops at its next boundary with a snapshot "
        "(docs/own-loop.md#data-loader-workers-and-a-stop)")


class StoppedMidStep(Exception):
    """Leaves the process group with an abort (no closing barrier: the ranks are not in step) and
    carries the exit code of the stop the attempt ended as."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the attempt ended as a stop (exit code {code})")
        self.code = code


def child_killed(error: BaseException) -> bool:
    """The error says a child process of this rank died (PyTorch's DataLoader reports its workers
    so)."""
    text = str(error)
    return any(part in text for part in CHILD_DEATHS)


def pipe_broke(error: BaseException) -> bool:
    """A pipe or socket to a child broke (a DataLoader's queue from a worker that died reads
    EOFError or ConnectionResetError): a child's death once a stop signal is here."""
    return isinstance(error, (EOFError, ConnectionError))


def stop_came_first(flag: StopFlag, error: BaseException, marker: Path | None = None,
                    wait_s: float = SIGNAL_WAIT_S, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep,
                    marked: Callable[[Path], bool] = jit_files.marked,
                    writes_the_line: bool = False) -> bool:
    """Whether the program's error is a stop's doing, not a failure; ``marker`` (the attempt's, in
    the run dir) tells the other ranks so; ``marked`` reads it (the failure path: once per node,
    :func:`hpc_ddp.rundir.jit_files.once_per_node`).

    - A child's death: a stop when this rank's own stop signal is here, or arrives within ``wait_s``
      (Slurm signals the child first as often as the rank).
    - A collective that failed because a peer left: a stop only when a peer marked its step as
      broken by the stop (it waited for nothing): srun's ``--kill-on-bad-exit`` and the rehearsal
      send the survivors of a lost rank a SIGTERM too, and that failure must stay a failure. Slurm
      signals node by node (2.5 s apart in a CI run under load), so a peer's stop can close its
      sockets before this rank's own signal arrives: the rank that ``writes_the_line`` (rank 0)
      then reads the mark, and where it is there waits up to ``wait_s`` for its signal. The other
      survivors of a failure never wait and never read the mark without their signal (a failure's
      run-dir work stays flat in the ranks: B14), and rank 0 reads it once.
    - A loader's pipe that broke as its worker died (EOFError, ConnectionError) once a stop signal
      is here: a stop. Any other error is a failure, whatever signal came with it (srun ends the
      survivors of a crash with SIGTERM too).
    """
    if child_killed(error):
        stopped = _signal_within(flag, wait_s, clock, sleep)
    # the peer marks before it leaves, so before its sockets close: no wait (a failure's
    elif peer_lost(error):
        # survivors must not linger: KillWait)
        if marker is None or not (flag.is_set or writes_the_line) or not marked(marker):
            return False
        # the peer stopped for a signal sent to the whole job: this rank's is on its way
        return _signal_within(flag, wait_s, clock, sleep)
    # a loader's pipe that broke as its worker died (EOFError, ConnectionResetError) once the stop
    # is here;
    else:
        stopped = flag.is_set and pipe_broke(error)  # any other error is a failure
    if stopped and marker is not None:
        _mark(marker)
    return stopped


def _signal_within(flag: StopFlag, wait_s: float, clock: Callable[[], float],
                   sleep: Callable[[float], None]) -> bool:
    """Whether this rank's stop signal is here, or arrives within ``wait_s``."""
    deadline = clock() + wait_s
    while not flag.is_set and clock() < deadline:
        sleep(0.05)
    return flag.is_set


def kept_step(run_dir: Path, offered: dict[str, Any] | None, wait_s: float = COMMIT_WAIT_S,
              clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> int | None:
    """The newest committed step, for the stop's ledger line. From ``snapshots/newest.json`` read
    by name (a listing of snapshots/ on this node may be 30 s old), else from the manifests. Where
    this rank wrote its share of a split survivors' snapshot (``offered``: its
    :func:`~hpc_ddp.rank.salvage.jit.after_failure`), the node that writes the last share commits
    it, often a moment after this rank's offer: wait up to ``wait_s`` for that commit (a CI run's
    ledger said "no snapshot" of a stop whose step 21 was committed a moment later)."""
    written = (offered or {}).get("written")
    wanted = written.get("step") if isinstance(written, dict) else None
    deadline = clock() + (wait_s if isinstance(wanted, int) else 0.0)
    while True:
        record = newest.read(run_dir)
        named = record["step"] if record is not None else None
        if wanted is None or (named is not None and named >= wanted):
            break
        if clock() >= deadline:
            log.warning("the snapshot of step %s this rank wrote a share of was not committed "
                        "within %g s", wanted, wait_s)
            break
        sleep(0.05)
    steps = snapshot.committed_steps(run_dir)
    known = [s for s in (named, steps[0] if steps else None) if s is not None]
    return max(known) if known else None


def _mark(marker: Path) -> None:
    """Written into (read by content: :func:`~hpc_ddp.rundir.jit_files.marked`)."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"broken by a stop signal\n")
        finally:
            os.close(fd)
    except OSError:
        pass


def peer_lost(error: BaseException) -> bool:
    """A collective failed because a peer's process left (its sockets closed)."""
    return isinstance(error, RuntimeError) and blames_a_peer(str(error))


def marker(run_dir: Path, env: DistEnv) -> Path:
    """The attempt's mark that a stop signal broke a step (in its survivors' snapshot folder)."""
    return jit_files.folder(run_dir, env.job_id, env.restart_count,
                            env.in_job) / jit_files.BROKEN_STOP_MARK
