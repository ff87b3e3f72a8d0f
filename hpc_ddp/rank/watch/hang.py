"""Who is stuck when a job hangs: where each rank is, and rank 0's verdict from those positions.

Pure functions for :mod:`hpc_ddp.rank.watch.watchdog`, which publishes each rank's :class:`Position`
in the process group's store and asks :func:`verdict` on rank 0. A rank's position is its last beat
(step, phase) and, once it has made no progress for ``dist.timeout_s``, where it stays (``final``)
with the last collective it entered on each process group (torch's flight recorder). The verdict
must not depend on timing: a rank that looks behind is named only once its position is final (a
stale one would name a rank that has moved on) and the ranks ahead of it are final too (they wait
for it; one that got ahead a moment ago does not, yet), and when every rank is at the same place it
waits twice the timeout (a start-up or snapshot write that every rank is slow in is not a hang). No
torch, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Order within a step: a rank in a later phase is waiting for the ones in earlier phases.
PHASES = ("start", "data", "forward", "backward", "optimizer", "boundary", "snapshot", "finish")
# process group -> the number of the last collective this rank entered on it
Issued = Mapping[str, int]
# a rank whose position could not be read (the store is gone): never named
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Position:
    """Where a rank is: its last beat, whether it is final (no progress for the timeout), and its
    collectives."""

    step: int
    phase: str
    final: bool = False
    issued: Issued | None = None

    def encode(self) -> str:
        tail = f":final:{json.dumps(dict(self.issued or {}), sort_keys=True)}" if self.final else ""
        return f"{self.step}:{self.phase}{tail}"

    @classmethod
    def decode(cls, text: str) -> Position | None:
        step, _, rest = text.partition(":")
        phase, _, final = rest.partition(":final:")
        if phase not in PHASES or not step.lstrip("-").isdigit():
            return None
        issued = json.loads(final) if final else None
        return cls(int(step), phase, bool(rest.count(":final:")), issued or None)


def laggards(beats: Sequence[tuple[int, str] | None]) -> list[int]:
    """The ranks whose (step, phase) is behind the rest; every rank that never beat counts as
    behind.

    Empty when all ranks are at the same place (then a collective itself hangs, or all are stuck).
    """
    keys = [(-1, -1) if beat is None else (beat[0], PHASES.index(beat[1])) for beat in beats]
    lowest = min(keys)
    behind = [rank for rank, key in enumerate(keys) if key == lowest]
    return [] if len(behind) == len(keys) else behind


def never_entered(issued: Mapping[int, Issued]) -> list[int]:
    """The ranks that never entered a collective the others of a process group entered, by group:
    they are where the others wait. ``issued``: rank -> its last collective per group (flight
    recorder)."""
    behind: set[int] = set()
    for group in {g for counts in issued.values() for g in counts}:
        seen = {rank: counts[group] for rank, counts in issued.items() if group in counts}
        top = max(seen.values())
        if len(seen) > 1:
            behind |= {rank for rank, seq in seen.items() if seq < top}
    return sorted(behind)


def verdict(positions: Sequence[Position | str | None], quiet_s: float,
            timeout_s: float) -> list[int] | None:
    """Rank 0's verdict: the stuck ranks ([] when every rank is at the same place), or None to wait.

    ``positions``: every rank's (None: never published; :data:`UNREADABLE`), rank 0's own final;
    ``quiet_s``: how long rank 0 has made no progress.
    """
    known = {r: p for r, p in enumerate(positions) if p != UNREADABLE}
    final = {r: p for r, p in known.items() if isinstance(p, Position) and p.final}
    if len(final) == len(positions) and all(p.issued for p in final.values()):
        stuck = never_entered({r: p.issued for r, p in final.items() if p.issued})
        if stuck:
            return stuck
    ranks = sorted(known)
    behind = [ranks[i] for i in laggards(places(list(known.values())))]
    # named once every rank is final, those ahead too: a rank ahead that is not quiet got there a
    # moment ago (the end of a slow start-up, which the rank behind is about to finish as well) and
    # waits for nobody yet
    if behind and len(final) == len(known):
        return behind
    return (behind if behind else []) if quiet_s >= 2 * timeout_s else None


def describe_hang(rank: int, timeout_s: float, beats: Sequence[tuple[int, str] | None],
                  stuck: Sequence[int] | None = None, quiet_s: float | None = None) -> str:
    """The message every watchdog logs; it names the stuck ranks (``stuck``: the verdict; else the
    laggards)."""
    mine = beats[rank]
    where = f"step {mine[0]} phase {mine[1]}" if mine else "start-up"
    stuck = laggards(beats) if stuck is None else list(stuck)
    quiet = f"{max(quiet_s, timeout_s):.0f}s" if quiet_s else f"{timeout_s:g}s"
    if not stuck:
        return (f"rank {rank}: no progress for {quiet} at {where}; every rank is at the same "
                "place, so a "
                "collective itself is stuck (network, NCCL) or every rank is stuck.\nHINT: the "
                "stacks below "
                "show where; NCCL_DEBUG=INFO (dist.nccl_env) logs the collectives; if every rank "
                "is merely slow "
                "there (a start-up, a snapshot write), raise dist.timeout_s")
    # named by the flight recorder: every rank last beat at the same place
    alike = not laggards(beats)
    named = ", ".join(f"rank {r}" + ("" if alike else " at "
                                     + (f"step {beats[r][0]} {beats[r][1]}" if beats[r]
                                                                  else "start-up"))
                      for r in stuck[:16])
    more = f" and {len(stuck) - 16} more" if len(stuck) > 16 else ""
    wait = (f"every rank last beat at {where}, and these never entered the collective the others "
            "wait in" if alike
            else "the other ranks wait for them in a collective")
    return (f"rank {rank}: no progress for {quiet} at {where}. Stuck: {named}{more}; {wait}."
            "\nHINT: the faulthandler stacks in the stuck ranks' logs show "
            "where they are (a data loader, I/O, code in the task, or a collective only some ranks "
            "call, such as "
            "a forward of the DDP model on rank 0 alone: docs/troubleshooting.md); `python -m "
            "hpc_ddp.status "
            "RUN_DIR` names the collective where the ranks parted")


def places(positions: Sequence[Position | str | None]) -> list[tuple[int, str] | None]:
    """(step, phase) of each position; None where unknown."""
    return [(p.step, p.phase) if isinstance(p, Position) else None for p in positions]
