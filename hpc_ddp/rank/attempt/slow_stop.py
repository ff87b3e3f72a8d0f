"""The agreed stop that was rank 0's own, to leave out a slow node (``slurm.straggler.action:
replace``, :mod:`hpc_ddp.rank.loop.pace`) or the nodes a health check found sick
(:mod:`hpc_ddp.rank.attempt.health`): no stop signal came, so it is neither a preemption nor
a time-out and nothing is requeued. Rank 0 writes a ``slow`` line naming the node (``replace``),
with the stop's snapshot committed; every rank exits :data:`~hpc_ddp.core.codes.EXIT_SLOW`, and the
batch shell (or the rehearsal's launcher) goes on without the node, as it heals a failed step
(:func:`hpc_ddp.shell.heal.replaced`), from that snapshot: no step is lost."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hpc_ddp.core.codes import EXIT_SLOW
from hpc_ddp.rank.attempt.context import Ending

if TYPE_CHECKING:
    from hpc_ddp.rank.attempt.context import Attempt
    from hpc_ddp.rank.loop.run import Run

log = logging.getLogger("hpc_ddp.session")


def slow_stop(attempt: Attempt, run: Run, step: int,
              ledger_line: Callable[..., Any]) -> Ending | None:
    """The stop's ending when it was agreed to replace a slow node and no signal came (a signal
    makes it that signal's stop, which requeues anyway); None otherwise. ``ledger_line``: the
    writer of the attempt's line (:func:`hpc_ddp.rank.attempt.conclude.ledger_line`)."""
    if not run.pace.agreed or attempt.flag.is_set:
        return None
    if attempt.env.is_main and not attempt.wrapped:
        host = run.pace.replacing.host if run.pace.replacing is not None else None
        hosts = run.pace.leave_out or ([host] if host else [])
        ledger_line(attempt, "slow", **({"replace": hosts} if hosts else {}))
        log.info("stopped at step %s to leave out %s %s: snapshot committed; the batch shell "
                 "goes on without %s on a spare or fewer nodes, or requeues where it cannot", step,
                 "the slow node" if len(hosts) < 2 else "the nodes", ", ".join(hosts),
                 "it" if len(hosts) < 2 else "them")
    return Ending(EXIT_SLOW)
