"""The boundary's agreement across ranks: stop? a snapshot due by rank 0's clock? a writer busy?
(And once a window, each rank's busy time per step: :mod:`hpc_ddp.rank.loop.pace`.)

Every rank's three flags are max-reduced on the CPU control group
(:mod:`hpc_ddp.rank.group.control`, or two levels through :mod:`hpc_ddp.rank.group.tiers`):
started at one boundary, read at the next, so the collective overlaps the step between them and a
stop lands one boundary after its signal, at the same step on every rank. Apart from
:mod:`hpc_ddp.rank.loop.run`, which says what the flags are and acts on the answer: this is only how
ranks agree on them.
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.rank.group import control, tiers

InFlight = tuple[Any, Any]  # (the flags or their tensor, the collective's work: None for one rank)


def start(flags: list[int], world_size: int) -> InFlight:
    """Start agreeing on ``flags``; :func:`read` the answer at the next boundary.

    One rank agrees with itself: its flags are kept as they are, with no collective (a gloo
    all_reduce of one rank still costs tens of µs, and milliseconds when its thread waits for a
    core), and the same one-boundary lag, so a stop lands on the same step as before."""
    if world_size == 1:
        return flags, None
    # on the CPU control group: reading a CUDA tensor back would wait for the GPU to drain the step
    return (tiers.current() or control).start_max(flags)


def read(in_flight: InFlight | None) -> tuple[tuple[bool, bool, bool], list[int]]:
    """The agreed (stop, due, busy) of an agreement :func:`start` began (none: nothing agreed), and
    what came after the three flags (once a window, every rank's pace: rank/loop/pace.py)."""
    if in_flight is None:
        return (False, False, False), []
    flags, work = in_flight
    if work is not None:
        work.wait()
        flags = flags.tolist()
    stop, due, busy = (bool(v) for v in flags[:3])
    return (stop, due, busy), list(flags[3:])
