"""The rank's side of a heal's timeline (:mod:`hpc_ddp.core.timeline`): when each phase of this
attempt ended.

``mark(phase)`` notes the wall-clock time in this process's memory; nothing is written then. Rank 0
puts the marks into its attempt's ledger line when it writes it (:func:`ledger_field`), so a heal
costs no file and no step pays anything but a dict lookup. Code that compiles the model calls
``mark("compiled", at, compile_cache="hit")``. The first mark of a phase wins: a phase ends once.
Lives below the loop (``metrics``) so that the loop, the session and compile support may all mark.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.core.errors import explain, UsageError

from hpc_ddp.core.timeline import EXTRAS, RANK_PHASES, for_attempt, shell_marks

_MARKS: dict[str, float] = {}
_EXTRAS: dict[str, Any] = {}


def mark(phase: str, at: float | None = None, **extra: object) -> None:
    """This attempt's ``phase`` ended at ``at`` (epoch seconds; now when None). ``extra``: facts for
    the timeline, e.g. ``compile_cache="hit"``."""
    if phase not in RANK_PHASES:
        raise UsageError(explain(f"timeline.mark: unknown phase {phase!r}",
                                 expected=", ".join(RANK_PHASES),
                                 hint='e.g. mark("compiled", compile_cache="hit")'), key="phase")
    if phase not in _MARKS:
        _MARKS[phase] = time.time() if at is None else float(at)
    for key, value in extra.items():
        if key not in EXTRAS:
            raise UsageError(explain(f"timeline.mark: unknown fact {key!r}",
                                     expected=", ".join(EXTRAS)), key=key)
        _EXTRAS.setdefault(key, value)


def marks() -> dict[str, float]:
    """The phases marked so far in this process (a copy)."""
    return dict(_MARKS)


def facts() -> dict[str, Any]:
    """The facts marked so far (``compile_cache``), a copy."""
    return dict(_EXTRAS)


def reset() -> None:
    """Forget every mark (a process that runs a second attempt: tests, a wrapped script's
    session)."""
    _MARKS.clear()
    _EXTRAS.clear()


def ledger_field(environ: Mapping[str, str], attempts: list[dict[str, Any]],
                 in_job: int) -> dict[str, Any]:
    """``{"timeline": {...}}`` for rank 0's ledger line, or {} (a run's first attempt).
    ``attempts``: the ledger as read when the attempt opened (its last line is the failed or stopped
    attempt before this one)."""
    previous = attempts[-1] if attempts else None
    timeline = for_attempt(shell_marks(environ), _MARKS, previous, in_job, _EXTRAS)
    return {"timeline": timeline} if timeline is not None else {}


def compile_field(report: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{"compile": {"cache": "miss", "s": 59.1, "graphs": 2}}`` for rank 0's ledger line of every
    attempt that compiled (its first, cold one too, which has no timeline), from
    :func:`hpc_ddp.rank.loop.compiling.compile_report`; {} when nothing was compiled."""
    if not report:
        return {}
    return {"compile": {"cache": report.get("cache"), "s": report.get("seconds"),
                        "graphs": report.get("graphs")}}


def process_start(stat: str | None = None, since_boot: float | None = None,
                  ticks: int | None = None) -> float | None:
    """When this process started, in epoch seconds: ``/proc/self/stat`` says when, in clock ticks
    after boot (10 ms), and ``CLOCK_BOOTTIME`` how long ago boot was (``/proc/stat``'s ``btime``
    is whole seconds: too coarse beside the shell's ``launched``). The timeline's ``started``,
    before Python imported anything. None where /proc cannot say (not Linux)."""
    import os

    try:
        stat = stat if stat is not None else Path("/proc/self/stat").read_text()
        now, booted = time.time(), (since_boot if since_boot is not None
                                    else time.clock_gettime(time.CLOCK_BOOTTIME))
        ticks = ticks or os.sysconf("SC_CLK_TCK")
        # after the command's closing parenthesis: field 3 on; starttime is field 22
        return now - (booted - int(stat.rpartition(")")[2].split()[19]) / ticks)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
