"""A failed step of a rehearsal settled as the batch shell settles one: its ledger line, then
heal or requeue.

On Slurm the batch shell records each step that failed (:func:`hpc_ddp.shell.settle.settle`) and
then heals it in the job or requeues the job; the rehearsal plays that part with the same
function, its healer (:mod:`hpc_ddp.rehearsal.local_heal`) standing in for the shell's. Apart
from :mod:`hpc_ddp.rehearsal.local`, which runs the attempts: this is what happens between two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from hpc_ddp.core.codes import exit_words
from hpc_ddp.core.hostlist import compress_hostlist
from hpc_ddp.rundir import layout, losses

if TYPE_CHECKING:
    from hpc_ddp.rehearsal.local_heal import LocalHealer


@dataclass(frozen=True)
class StepEnd:
    """One step that ended: the run, the attempt's place (job, requeue, its number in the ledger,
    whose logs are ``attempt-{index}-rank-*.log``), its exit code, and when it started and how
    (``times``: the batch shell's part of the timeline, as the step's environment had it)."""

    config_path: Path
    run_dir: Path
    job_id: int
    restart: int
    code: int
    index: int
    started: float
    times: dict[str, str]


def settle_step(step: StepEnd, healer: LocalHealer, watch: dict[str, object], err: IO[str]) -> bool:
    """Record the failed step and let the healer plan the next one; say so on ``err``. True when
    the job was requeued (the healer's :meth:`advance` says whether the job heals it instead)."""
    from hpc_ddp.core.timeline import TIMELINE_VAR
    from hpc_ddp.shell.last_known import last_known
    from hpc_ddp.shell.settle import limits_of, settle
    from hpc_ddp.shell.shell_rules import shell_timeline

    run_dir, job_id, restart, code = step.run_dir, step.job_id, step.restart, step.code
    requeued: list[bool] = []
    failed = list(watch.get("failed") or [])  # type: ignore[call-overload]
    outcome = settle(run_dir, job_id=job_id, restart_count=restart, exit_code=code,
                     limits=limits_of(step.config_path)[1],
                     requeue_job=functools.partial(requeued.append, True), in_job=healer.index,
                     heal=lambda record: healer.heal(record, failed,
                                                     last_known(run_dir)["last_step"]),
                     logs=lambda: sorted(layout.logs(run_dir).glob(
                         f"attempt-{step.index}-rank-*.log")),
                     extra={"hosts": compress_hostlist(healer.training), "start": step.started,
                            **shell_timeline(step.times[TIMELINE_VAR], healer.index),
                            **losses.ledger_fields(run_dir, job_id, restart, healer.index)})
    why_not, healer.memory.why_not = healer.memory.why_not, ""
    err.write(f"[local] attempt {step.index} (requeue {restart}, job step {healer.index}) ended, "
              f"{exit_words(code)}: {outcome}"
              + (f" (not healed in the job: {why_not})" if why_not else "") + "\n")
    return bool(requeued)
