"""What a rank does after a failure: its one front door, whichever way the failure came in.

A rank learns of a failure in one of four ways:

- **the program raised**: a collective failed because a peer died, or the program itself crashed.
  The exception reaches :func:`~hpc_ddp.rank.attempt.session.open_run` on the training thread, which
  hands it to :func:`after_exception`;
- **liveness found a peer silent** (this rank watched it and declares it lost), **or heard a
  declaration** made by another rank (:mod:`hpc_ddp.rank.watch.liveness`): its side thread calls the
  callbacks that
  :func:`wire` and :func:`exit_lost` / :func:`exit_heard` give it;
- **the watchdog found no progress** for ``dist.timeout_s`` (:mod:`hpc_ddp.rank.watch.watchdog`):
  its side thread calls :func:`on_hang`;
- **a stop broke the step**: the stop signal killed a child or a peer that had already stopped made
  a collective fail. It arrives as a raised exception, and :func:`after_exception` tells it apart
  from a failure (:mod:`hpc_ddp.rank.stop.broken_step`) and ends the attempt as the stop it was.

Then the same phases, in this order, each on the thread that noticed:

1. **flight dump**: which collective this rank waits in (:func:`hpc_ddp.rundir.flight.record`),
   kept on its node before anyone exits, and published with its node's others as one file per node
   after phase 2, before the rank waits to exit (:mod:`hpc_ddp.rundir.flight_node`). Only for a
   hang, on the watchdog's thread; NCCL's own watchdog dumps on a collective's timeout.
2. **survivors' snapshot**: ``attempt.after_failure``
   (:func:`hpc_ddp.rank.salvage.jit.after_failure`, once per process whichever thread comes first:
   :class:`~hpc_ddp.rank.salvage.jit.OneHandler`). Inline on the training thread; bounded by
   ``SIDE_WAIT_S`` on the liveness and watchdog threads, which must exit.
3. **ledger line**: rank 0 writes ``hung`` on the watchdog's thread (:func:`on_hang`), or the stop's
   line on the training thread (:func:`~hpc_ddp.rank.attempt.conclude.end_as_stop`). A raised
   failure or a lost rank gets no line here: the batch shell's settle step writes ``failed`` (with
   the lost-rank markers that liveness wrote).
4. **exit code** (:mod:`hpc_ddp.core.codes`): ``EXIT_HUNG`` for a hang, ``EXIT_LOST`` for the rank
   that declared a peer lost, ``EXIT_FAILED`` for one that heard the declaration, all by
   ``exit_fast`` from the side thread (the training thread may be stuck in a collective); the stop's
   code for a broken step (:class:`~hpc_ddp.rank.stop.broken_step.StoppedMidStep`); for a raised
   failure, the worker's exit 1.

What happens next is the batch shell's: :mod:`hpc_ddp.shell.settle`, then :mod:`hpc_ddp.shell.heal`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_ddp.core.codes import EXIT_FAILED, EXIT_HUNG, EXIT_LOST
from hpc_ddp.rank.attempt.conclude import end_as_stop, ledger_line
from hpc_ddp.rank.metrics import timeline
from hpc_ddp.rank.stop.broken_step import StoppedMidStep, marker, stop_came_first
from hpc_ddp.rank.watch.watchdog import poll_interval
from hpc_ddp.rundir import flight, flight_node, jit_files, losses

if TYPE_CHECKING:
    from hpc_ddp.rank.attempt.context import Attempt
    from hpc_ddp.rank.loop.run import Run

# the 0.1 logger name: users' log filters and the tests grep it
log = logging.getLogger("hpc_ddp.session")


class PeerLost(RuntimeError):
    """What a just-in-time snapshot follows when this rank's liveness thread found its peer frozen,
    or its watchdog found another rank stuck."""


def wire(attempt: Attempt, run: Run) -> None:
    """Once the run exists: the survivors' snapshot of this run becomes ``attempt.after_failure``,
    and a frozen peer found by liveness starts it too (the rank that finds it writes what it holds,
    from the liveness thread, then exits, whatever the write waits for)."""
    from hpc_ddp.rank.salvage import jit

    attempt.after_failure = jit.OneHandler(functools.partial(jit.after_failure, run))
    attempt.progress = lambda: (run.resumed_from, run.step)
    if attempt.liveness is not None:
        attempt.liveness.before_exit = lambda message: attempt.after_failure(
            PeerLost(message), wait_s=jit.SIDE_WAIT_S)


def exit_lost(message: str) -> None:
    """Liveness, after this rank declared a silent peer lost (its marker written, its snapshot
    done)."""
    _exit(EXIT_LOST)


def exit_heard(message: str) -> None:
    """Liveness, after this rank heard another rank's declaration (its snapshot done)."""
    _exit(EXIT_FAILED)


def on_hang(attempt: Attempt, timeout_s: float) -> Callable[[str, list[int]], None]:
    """The watchdog's callback: rank 0 records the hang (naming the stuck ranks) before the process
    ends.

    The other ranks wait a little before exiting: the stuck rank's watchdog fires first (its
    last beat is the oldest), and its exit would make rank 0's collective fail before rank 0's
    own watchdog could record the hang.
    """
    return functools.partial(_hung, attempt, timeout_s)


def _hung(attempt: Attempt, timeout_s: float, message: str, stuck: list[int]) -> None:
    """:func:`on_hang`'s phases, on the watchdog's thread."""
    env = attempt.env
    spot = flight_node.spot_for(attempt.run_dir, env)
    dumped = _keep_flight(spot)  # which collective this rank is in, before anyone exits
    # it waits in a collective: it holds a step
    if attempt.after_failure is not None and env.rank not in stuck:
        from hpc_ddp.rank.salvage.jit import SIDE_WAIT_S

        attempt.after_failure(PeerLost(message.splitlines()[0]), wait_s=SIDE_WAIT_S)
    # the node's dumps, as one file, before the wait below: rank 0's exit ends the step, and the
    # launcher's SIGKILL (a grace of 3 s locally, KillWait on Slurm) may come before the wait ends
    published = flight_node.publish(spot) if dumped else None
    if published is not None:
        log.error("the collectives this rank was in: %s", published)
    if not env.is_main:
        time.sleep(min(30.0, 2 * poll_interval(timeout_s) + 2))
    if env.is_main and not attempt.wrapped:
        resumed, step = attempt.progress() if attempt.progress is not None else (None, None)
        ledger_line(attempt, "hung", end=round(time.time(), 3),
                    **({} if step is None else {"first_step": resumed or 0, "last_step": step,
                                                "resumed_from": resumed}),
                    **timeline.ledger_field(attempt.environ, attempt.attempts, env.in_job),
                    stuck_ranks=stuck, message=message.splitlines()[0],
                    **losses.jit_fields(attempt.run_dir, env.job_id, env.restart_count, env.in_job),
                    **({"collectives": str(Path(spot.prefix).relative_to(attempt.run_dir))}
                       if dumped else {}))
    if attempt.liveness is not None:
        attempt.liveness.leave()  # this exit is the hang's, not a lost rank's
    _exit(EXIT_HUNG)


def _keep_flight(spot: flight_node.Spot) -> bool:
    """This rank's flight record, kept on its node; whether there was one to keep (never an
    error: the dump is a diagnosis)."""
    try:
        found = flight.record()
        if found is not None:
            flight_node.keep(spot, found)
        return found is not None
    except OSError as err:
        log.warning("the flight record could not be kept on the node: %s", err)
        return False


def after_exception(attempt: Attempt, run: Run, err: Exception) -> None:
    """The program raised (not an explained error of its own): on the training thread, inside
    ``open_run``'s ``except``. This rank writes what it holds; where a stop signal broke the step,
    rank 0 writes the stop's ledger line and this raises :class:`StoppedMidStep` with the stop's
    exit code. Otherwise it returns, and ``open_run`` re-raises ``err`` with its traceback as it
    came: the worker reports it and exits 1, and the batch shell's settle step writes the ``failed``
    line."""
    offered = attempt.after_failure(err)
    # a stop broke the step
    if stop_came_first(attempt.flag, err, marker(attempt.run_dir, attempt.env),
                       marked=_marked_once_per_node(attempt),
                       writes_the_line=attempt.env.is_main):
        attempt.code = end_as_stop(attempt, run, err,
                                   offered if isinstance(offered, dict) else None)
        raise StoppedMidStep(attempt.code) from err


def _marked_once_per_node(attempt: Attempt) -> Callable[[Path], bool]:
    """The broken-stop mark read once for the node's survivors, not once per rank (issue 59: B14's
    failure row grew with the ranks per node); read directly where the node's folder fails."""
    post = jit_files.post_for(attempt.run_dir, attempt.env)

    def marked(path: Path) -> bool:
        try:
            return bool(jit_files.once_per_node(post, "broken-stop",
                                                lambda: jit_files.marked(path)))
        except Exception:  # noqa: BLE001  (the node's folder: the failure path goes on)
            return jit_files.marked(path)

    return marked


def _exit(code: int) -> None:
    """The process ends now, from whichever thread: the training thread may wait in a collective
    forever."""
    from hpc_ddp.core.shutdown import exit_fast

    exit_fast(code)
