"""What rank 0's worker learns from its script's progress lines, made visible: the step for
``status`` (:mod:`hpc_ddp.rundir.script_progress`) and, on an attempt that continues the run, the
step the script resumed from, for the ledger line.

A script resumes from its own checkpoint, which hpc_ddp does not read. Its first progress line of
the attempt says where it went on: a line that says it resumes (``resuming ... step 300``) names the
step itself; otherwise the first step it prints is taken as one past the step it resumed from (exact
for a script that prints every step, at most its print interval early otherwise). No torch.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from hpc_ddp.rank.attempt.context import Attempt
from hpc_ddp.rank.metrics import timeline
from hpc_ddp.rank.script.output import Progress
from hpc_ddp.rundir import script_progress
from hpc_ddp.rundir.ledger import attempt_tag

log = logging.getLogger("hpc_ddp.script")
RESUMING = re.compile(r"(?i)\bresum")
# a continued attempt whose first step is within a tenth of the run's furthest step started over
NEAR_ZERO = 10


def started_over(first_step: int | None, first_line: str, attempts: list[dict[str, Any]],
                 resume_args: list[str]) -> str | None:
    """A warning when a continued attempt's script started again at (or near) step 0 although an
    earlier attempt had reached step N > 0: the script did not resume (no ``train.resume_args``, or
    no checkpoint of its own to resume from) and redoes the run's work, on every requeue. None
    otherwise."""
    reached = max((a["last_step"] for a in attempts if isinstance(a.get("last_step"), int)
                   and not isinstance(a.get("last_step"), bool)), default=0)
    if first_step is None or reached <= 0 or first_step > max(1, reached // NEAR_ZERO):
        return None
    said = (f"train.script started again at step {first_step} ({first_line!r}) although the run "
            f"had reached step {reached}: it did not resume, and redoes that work on every requeue")
    if not resume_args:
        return (f"{said}. train.resume_args is not set, so hpc_ddp told it nothing: set "
                "train.resume_args to what "
                "makes it load its own checkpoint (nanoGPT: ['--init_from=resume'])")
    return (f"{said}. train.resume_args {resume_args} were appended: did it find no checkpoint of "
            "its own? It must "
            "save one often enough to have one at a stop (nanoGPT: eval_interval, "
            "always_save_checkpoint=True)")


def resumed_from(progress: Progress, continues: bool) -> int | None:
    """The step the script resumed from, by its first progress line; None on a fresh start (or none
    yet)."""
    if not continues or progress.first_step is None:
        return None
    step = progress.first_step if RESUMING.search(progress.first_line) else progress.first_step - 1
    return step if step > 0 else None


class Publisher:
    """Polled by the worker's loop (its main thread) while the script runs, and once at the end."""

    def __init__(self, attempt: Attempt, progress: Progress,
                 every_s: float = script_progress.EVERY_S) -> None:
        self.attempt, self.progress, self.every_s = attempt, progress, every_s
        self.points: list[dict[str, Any]] = []
        self.written_at = 0.0
        self.started = False
        # for the ledger's note (already there) and DONE.json's warnings
        self.warnings: list[str] = []

    def poll(self, final: bool = False) -> None:
        progress, now = self.progress, time.time()
        if not self.started and progress.first_step is not None:
            self.started = True
            self._first(resumed_from(progress, bool(self.attempt.attempts)))
        step = progress.step
        if step is None or (self.points and self.points[-1]["step"] == step) or \
                (not final and now - self.written_at < self.every_s):
            return
        self.points = [*self.points, script_progress.point(step, progress.line,
                                                           now)][-script_progress.KEEP:]
        self.written_at = now
        env = self.attempt.env
        script_progress.write(self.attempt.run_dir, {
            "attempt": attempt_tag(env.job_id, env.restart_count, env.in_job),
            "resumed_from": self.attempt.record.get("resumed_from"), "points": self.points})

    def _first(self, resumed: int | None) -> None:
        """The ledger line's first step and the step resumed from (every line rank 0 writes takes
        the record), and a warning when a continued attempt started over (:func:`started_over`)."""
        self.attempt.record.update(first_step=resumed or 0, resumed_from=resumed)
        # the script's first progress line: its first step of this attempt
        timeline.mark("first_step")
        warning = started_over(self.progress.first_step, self.progress.first_line,
                               self.attempt.attempts,
                               list(self.attempt.cfg.train.resume_args or []))
        if warning is not None:
            self.warnings.append(warning)
            record = self.attempt.record
            record["note"] = "; ".join(filter(None, [record.get("note"), warning]))
            log.warning("%s", warning)
        if resumed is not None:
            self.attempt.record["resumed_from_by"] = ("the script's first progress line: "
                                                     f"{self.progress.first_line!r}")
            log.info("the script resumed from step %d, by its first progress line (%r)", resumed,
                     self.progress.first_line)
