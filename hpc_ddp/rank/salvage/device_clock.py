"""Which step a rank's device memory holds after a failure: events around each optimizer update,
read by a decision that never waits (issue 58).

**The host runs ahead of the device.** On NCCL, when a peer dies inside step k+1's gradient
all-reduce, a survivor's CPU has usually gone on: it called ``optimizer.step()`` for k+1 (its
kernels queued behind the wedged all-reduce) and may have passed ``run.boundary(k+1)``. What the
host did says nothing about what the memory holds; the device does. So each boundary (a
:class:`Mark`) records an event after its copies, and the update after it records one as it begins
(the first optimizer's step pre-hook) and one as it ends (the last one's post-hook), on the stream
that runs it. After a failure, a survivor holds step k when k's mark event has completed and the
update after k has not begun on the device (its event not completed, or never recorded): step k+1's
update kernels wait behind the wedge, and the memory is still step k's. The host-side state of the
last two boundaries is kept for this (:class:`hpc_ddp.rank.salvage.held.Held`).

**A seam for the device clock.** The decision (:func:`holding`) takes the marks and a :class:`Clock`
that records and queries events, so it is tested on the CPU with events that complete, stall or
never come (tests/rank/test_device_clock.py). :class:`HostClock` is the CPU's: an event is done when
it is recorded, which gives the host's own order (an update that began on the host has begun).
:class:`CudaClock` records ``torch.cuda.Event`` on the current stream and queries it: nothing here
ever waits on the device.

**Intact, checked after the read.** A state read on a side stream (or by a side thread while
training went on: a false alarm) is step k's only if the update after k had not begun when the read
was done: :func:`intact`, asked once the read's own event completed. The update's kernels run after
its begin event on the update stream, so a begin event not yet completed then means none of them
ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class Clock(Protocol):
    """Records events in the order of the stream that runs the updates, and says whether one
    completed."""

    # True where the device may be behind the host (a GPU): the messages say "GPU"
    device: bool

    def record(self) -> Any: ...

    def done(self, event: Any) -> bool: ...  # never waits


class HostClock:
    """The CPU's clock: the host is the device, so an event has completed when it is recorded."""

    device = False

    def record(self) -> Any:
        return True

    def done(self, event: Any) -> bool:
        return True


class CudaClock:
    """A CUDA event recorded on the current stream (the one running the update or the boundary's
    copies), queried, never synchronized."""

    device = True

    def record(self) -> Any:
        import torch

        event = torch.cuda.Event()
        event.record()
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())


@dataclass
class Mark:
    """One boundary's host-side state and the device events around it. ``copies`` is what the
    boundary copied (buffers, optimizer settings, plain states); ``synced_copies`` the buffers
    copied again after the boundary broadcast rank 0's (:meth:`Held.synced`), valid once
    ``synced_event`` completed."""

    step: int
    copies: dict[str, Any]
    event: Any  # the boundary's copies are done on the device
    began: Any = None  # the update after this step began (None: not on the host yet)
    ended: Any = None  # ... and ended
    synced_copies: dict[str, Any] | None = None
    synced_event: Any = None
    # a GPU's: each optimizer's host-side state as its update after this step began (held_copies)
    host: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Holding:
    """The step a rank holds: its mark, and whether rank 0's buffers are in it."""

    mark: Mark
    synced: bool

    @property
    def step(self) -> int:
        return self.mark.step

    @property
    def copies(self) -> dict[str, Any]:
        if self.synced and self.mark.synced_copies is not None:
            return {**self.mark.copies, **self.mark.synced_copies}
        return self.mark.copies


def holding(marks: list[Mark], clock: Clock) -> Holding | str:
    """The newest of ``marks`` (oldest first) whose step the memory still holds, or why none: its
    mark event completed and the update after it had not begun. Never waits."""
    if not marks:
        return "this rank had not finished run.resume()"
    newest = marks[-1]
    reason: str | None = None
    for mark in reversed(marks):
        # then every older mark's update had begun too (the stream runs them in order)
        if mark.began is not None and clock.done(mark.began):
            return _updating(mark, clock)
        if not clock.done(mark.event):
            reason = reason or _behind(mark, clock)
            continue
        synced = mark.synced_event is not None and clock.done(mark.synced_event)
        return Holding(mark, synced)
    return reason or f"no boundary of this rank before step {newest.step} is held"


def intact(mark: Mark, clock: Clock) -> bool:
    """Whether the live state read for ``mark`` (after the read completed) is still its step's: the
    update after it had not begun (module docstring)."""
    return mark.began is None or not clock.done(mark.began)


def _updating(mark: Mark, clock: Clock) -> str:
    """Why ``mark`` is not held: the update after it had begun (on the host for a CPU; on the
    device, and ended or not, for a GPU)."""
    step = mark.step
    if not clock.device:
        return (f"this rank's optimizer had begun the update after step {step} and its "
                f"run.boundary({step + 1}) had not come")
    if mark.ended is None or not clock.done(mark.ended):
        return (f"this rank's GPU had begun the update of step {step + 1} and not finished it: "
                f"neither step {step} nor step {step + 1} is whole in its memory")
    return (f"this rank's GPU had finished the update of step {step + 1} but its "
            f"run.boundary({step + 1}) had not come (the code between the optimizer and the "
            "boundary may not have run)")


def _behind(mark: Mark, clock: Clock) -> str:
    return (f"this rank's GPU had not finished the work of step {mark.step} (its "
            f"run.boundary({mark.step}) came first on the host; a collective on the device may be "
            "wedged): its state cannot be read")
