"""The rehearsal's hooks on the rank's side: what ``submit --local`` and the tests inject into an
attempt.

The local launcher (:mod:`hpc_ddp.rehearsal`) watches rank 0's output for progress lines and sends
its stop signals at the steps asked for (``--preempt-at``, ``--timeout-at``); ``--fail-at`` kills a
rank after a step, as a lost node; ``HPC_DDP_FAULT_POINT`` signals a rank in the middle of a
snapshot's write. Only the local launcher and the tests set the variables that turn these on. Kept
apart so that the session composes the attempt and nothing else, and one call (:func:`on_step`) arms
all of it.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hpc_ddp.core.codes import DIE_AT_VAR, HOLD_AT_VAR

if TYPE_CHECKING:
    from hpc_ddp.core.stopping import StopFlag
    from hpc_ddp.rank.attempt.context import Attempt
    from hpc_ddp.rank.loop.run import Run

# the longest rank 0 waits at a step for the rehearsal's injected signal (ms when all is well;
HOLD_S = 60.0
# 10 s ran out once in CI, a launcher starved by a loaded machine, and the stop under test never
# happened)
# how long --fail-at waits for a victim's per-rank state to be posted before it kills it
DIE_WAIT_S = 5.0
# and then, as a node lost during the next step (its peers wait for it in that step's all-reduce,
# holding the step before): the buddy's transport has drained the state before the kill's reset
# (a reset discards what the buddy had not read yet: a warm-started rehearsal, fast enough to kill
# within a millisecond of the send, left the buddy a step behind once in six under load)
DIE_DURING_S = 1.0
FAULT_POINT_VAR = "HPC_DDP_FAULT_POINT"  # tests only: rundir/snapshot/store.py's FAULT_POINT


def on_step(attempt: Attempt, run: Run) -> Callable[[int], None] | None:
    """What ``run`` calls after each step (``run.on_step``), or None outside a rehearsal; also arms
    the snapshot writer's fault point (tests only), before the run writes anything."""
    # the module that reads it (the folder's __init__ only re-exports names)
    from hpc_ddp.rundir.snapshot import store

    environ = attempt.environ
    store.FAULT_POINT = environ.get(FAULT_POINT_VAR)
    hook: Callable[[int],
                   None] | None = print_progress if attempt.local and attempt.env.is_main else None
    if hook is not None and environ.get(HOLD_AT_VAR):  # the rehearsal's --preempt-at/--timeout-at
        hook = functools.partial(_hold_for_stop, _steps(environ[HOLD_AT_VAR]), attempt.flag)
    # the rehearsal's --fail-at: this rank's node is lost after that step
    if environ.get(DIE_AT_VAR):
        hook = functools.partial(_die_after, int(environ[DIE_AT_VAR]), hook, run)
    return hook


def _die_after(last: int, then: Callable[[int], None] | None, run: Run, step: int) -> None:
    """Fault injection (``--fail-at``): SIGKILL this rank once its boundary of ``last`` has run and
    its per-rank state of that step has left for its buddy (posted by the mirror's sender thread,
    within a millisecond or so), ``DIE_DURING_S`` later, as a node lost during the next step: its
    peers cannot pass that step's all-reduce without it, so they still hold ``last``."""
    if then is not None:
        then(step)
    if step >= last:
        if run.mirror is not None and run.mirror.wait_sent(step, DIE_WAIT_S):
            time.sleep(DIE_DURING_S)
        os.kill(os.getpid(), signal.SIGKILL)


def _steps(text: str) -> frozenset[int]:
    return frozenset(int(part) for part in text.split(",") if part.strip())


def _hold_for_stop(steps: frozenset[int], flag: StopFlag, step: int) -> None:
    """The rehearsal's injected stop (``--preempt-at``/``--timeout-at``): rank 0 reports the step
    and waits, at most ``HOLD_S``, for the signal the launcher sends on reading that report. Without
    the wait a short run on a loaded machine could finish before the signal lands, and the stop
    under test would never happen."""
    print_progress(step)
    deadline = time.monotonic() + HOLD_S
    while step in steps and not flag.is_set and time.monotonic() < deadline:
        time.sleep(0.01)


def print_progress(step: int) -> None:
    """The local simulation watches rank 0 for these lines to inject signals at chosen steps.

    One write of the whole line: ``print`` writes the text and its newline apart (the rehearsal's
    ranks run unbuffered), and a log line from another thread (the node's binding line) could land
    between them; the rehearsal then read ``... step 0[rank 0] ...`` and its tee died on it, so no
    injected stop ever fired."""
    from hpc_ddp.core.codes import PROGRESS_MARK

    sys.stdout.write(f"{PROGRESS_MARK}{step}\n")
    sys.stdout.flush()
