"""What the ledger says about a run as a whole, for ``status``: the steps each failure threw away
and the jobs the run went on through.

Apart from :mod:`hpc_ddp.rundir.ledger`, which writes the attempts' lines, merges them and counts
the caps: these are read-only summaries over the attempts it reads, which only ``status`` shows.
No torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

FAILURE_REASONS = ("failed", "lost", "hung")  # the attempts that end without a stop snapshot


def steps_lost(attempts: list[dict[str, Any]],
               newest: int | None = None) -> dict[int, dict[str, Any]]:
    """Per failed attempt (by index): the steps its failure threw away, ``last_step`` (how far it
    got, by its ledger line) less the step the next attempt resumed from (or, before there is one,
    where the next will resume: ``newest``, the newest committed snapshot, else the snapshot its
    line names). A stop loses nothing by design and is not listed; an attempt whose figures are
    missing is listed without ``lost``; ``why``: the ledger's reason the survivors wrote no
    snapshot, where steps were lost."""
    found: dict[int, dict[str, Any]] = {}
    for i, attempt in enumerate(attempts):
        if attempt.get("reason") not in FAILURE_REASONS:
            continue
        after = attempts[i + 1] if i + 1 < len(attempts) else None
        # a hung line names no snapshot: where the next resumes is the newest committed step
        pending = newest if newest is not None else attempt.get("snapshot")
        resumed = after.get("resumed_from") if after is not None else pending
        last = attempt.get("last_step")
        entry: dict[str, Any] = {"last_step": last, "resumed_from": resumed,
                                 "pending": after is None}
        if isinstance(last, int):
            entry["lost"] = last - (resumed if isinstance(resumed, int) else 0)
        if entry.get("lost") and attempt.get("jit_fallback"):  # why the survivors wrote no snapshot
            entry["why"] = attempt["jit_fallback"]
        jit = attempt.get("jit_snapshot")
        if isinstance(jit, dict) and isinstance(jit.get("per_rank_stale"), dict):  # mirror=N
            entry["per_rank_from"] = jit["per_rank_stale"]
        if isinstance(jit, dict) and isinstance(jit.get("per_rank_held_by"), dict):
            entry["buddies"] = jit["per_rank_held_by"]  # lost ranks' states, from their mirrors
        found[i] = entry
    return found



def chain_jobs(attempts: Sequence[Mapping[str, Any]], current: str | None = None) -> list[str]:
    """The jobs of a run in order (each once), with the last chained ``next_job`` and ``current``
    (job.json's) after them: ``["5", "7", "9"]`` for a run that went on through two chained jobs."""
    jobs: list[str] = []
    for attempt in attempts:
        for job in (attempt.get("job_id"), attempt.get("next_job")):
            if job is not None and str(job) not in jobs:
                jobs.append(str(job))
    if current and current not in jobs:
        jobs.append(current)
    return jobs
