"""The batch shell's calls of the healer: one that can never end the job without its requeue path
(:func:`safe_heal`), and the step that every rank stopped to leave out a slow node
(:func:`replace`, ``slurm.straggler.action: replace``: :mod:`hpc_ddp.rank.attempt.slow_stop`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Heal = Callable[[Mapping[str, Any]], "str | None"]


def safe_heal(heal: Heal | None, record: Mapping[str, Any]) -> tuple[str | None, str]:
    """The healer's plan, or None and why not when it raised: a healer's bug (an scontrol line it
    cannot read, a file it cannot list) must fall back to the requeue path, never end the job
    without one."""
    if heal is None:
        return None, ""
    try:
        return heal(record), ""
    # any error: the requeue path still runs, and the ledger names it
    except Exception as err:  # noqa: BLE001
        return None, f"{type(err).__name__}: {err}"


def replace(record: Mapping[str, Any], heal: Heal | None,
            requeue_job: Callable[[], str | None] | None) -> str:
    """Every rank stopped with a snapshot to leave out a slow node: the job goes on without it,
    healed inside the job as a failed step is (the node a hard suspect:
    :func:`hpc_ddp.shell.heal.replaced`); where that cannot be (no spare left, the in-job restarts
    used up), the stop is requeued like a time-out, no failure counted (its snapshot is whole)."""
    healing, problem = safe_heal(heal, record)
    if healing:
        return f"slow: {healing}"
    why = problem or "not healed in the job"
    if requeue_job is None:
        return f"slow; {why}; not requeued (no job to requeue)"
    return f"slow; {why}; {requeue_job() or 'requeued'}"
