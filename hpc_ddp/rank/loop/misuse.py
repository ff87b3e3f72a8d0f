"""A loop's wrong calls of the run API, said as usage errors that name the fix (never retried).

``run.resume`` with positional objects or called twice; ``run.boundary`` before the resume, after
it returned True, or with a step that does not rise by one per call. Apart from
:mod:`hpc_ddp.rank.loop.run`, so that the stop protocol there reads as the protocol; the session
catches :class:`LoopIgnoredStop` to end the attempt as the stop it was
(:mod:`hpc_ddp.rank.attempt.session`).
"""

from __future__ import annotations

from hpc_ddp.core.errors import explain
from hpc_ddp.rank.state.tracked import RunUsageError

RESUME_HINT = ("run.resume(model=model, optimizer=optimizer, sampler=sampler): the names key the "
               "snapshot")
STOP_HINT = ("leave the loop (return) when run.boundary(step) is True: the snapshot is committed "
             "and the job is being requeued")
STEP_EXPECTED = "the optimizer step count, an int rising by one per call"
STEP_HINT = "start from step = run.resume(...) and add 1 after each step"


class LoopIgnoredStop(RunUsageError):
    """The loop called run.boundary again after it returned True. The session ends the attempt as
    the stop it was (the stop snapshot is committed; the steps after it are dropped) and the ledger
    says so."""


def check_resume(positional: tuple[object, ...], resumed: bool) -> None:
    """``run.resume(*positional, ...)``: objects go in by name, and it is called once."""
    if positional:
        names = ", ".join(type(p).__name__ for p in positional)
        raise RunUsageError(explain(f"run.resume() takes its objects by name; found "
                                    f"{len(positional)} positional argument(s) ({names})",
                                    hint=RESUME_HINT))
    if resumed:
        raise RunUsageError(explain("run.resume() was called twice",
                                    hint="call it once, before the loop"))


def check_step(step: object, last: int, resumed: bool, stopped: bool) -> None:
    """``run.boundary(step)`` after ``run.boundary(last)``: resumed, not stopped, rising."""
    if not resumed:
        raise RunUsageError(explain(
            "run.boundary() before run.resume()",
            hint="call step = run.resume(model=..., optimizer=...) before the loop"))
    if stopped:
        raise LoopIgnoredStop(explain(f"run.boundary({step}) after it returned True at step {last}",
                                      hint=STOP_HINT))
    if not isinstance(step, int) or step <= last:
        kind = "" if isinstance(step, int) else f" (a {type(step).__name__}, not an int)"
        raise RunUsageError(explain(f"run.boundary() got step {step!r}{kind} after step {last}",
                                    expected=STEP_EXPECTED, hint=STEP_HINT))
