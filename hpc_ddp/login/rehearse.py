"""``submit --local``: the rehearsal driven from the login node's command line, and the outcome line
it prints (finished, stopped, failed), read back from the run dir.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from hpc_ddp.login.dry_run import shape
from hpc_ddp.login.guards import check_free, write_config, write_job
from hpc_ddp.rundir import layout
from hpc_ddp.core.batching import node_counts, slurm_nodes
from hpc_ddp.core.config import RunConfig


def check_program(cfg: RunConfig) -> None:
    """The checks of the program that ``--dry-run`` and a submit make (train.script's file,
    train.task's or train.loop's module), before a rehearsal creates the run dir and starts ranks
    that would each fail at once. Prints the warnings; raises with the errors."""
    import sys

    from hpc_ddp.core.errors import HpcDdpError
    from hpc_ddp.login.preflight.program import check_task

    findings = check_task(cfg)
    for finding in findings:
        if finding.level != "error":
            print(finding, file=sys.stderr)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise HpcDdpError("preflight found problems; nothing was rehearsed (--no-preflight skips "
                          "the checks)\n"
                          + "\n".join(map(str, errors)), key=errors[0].key)


def run_local(cfg: RunConfig, preempt_at: list[int], timeout_at: list[int], resume: bool = False,
              again: str = "", fail_at: list[tuple[int, int | None]] | None = None,
              freeze_at: list[tuple[int, int | None]] | None = None) -> int:
    """Rehearse ``cfg`` here; ``again`` is the command that continues it (shown after Ctrl-C). The
    submit command runs :func:`check_program` on every config before the first rehearsal starts."""
    from hpc_ddp.core.codes import EXIT_INTERRUPTED
    from hpc_ddp.rehearsal.local import rehearse
    from hpc_ddp.core.stopping import signal_number
    from hpc_ddp.rundir.snapshot.steps import committed_steps

    run_dir = Path(cfg.run_dir)
    check_free(cfg, resume)
    config_path = write_config(cfg, resume)
    job_id = int(time.time()) % 10**6
    write_job(run_dir, {"job_id": job_id, "local": True, "host": socket.gethostname(),
                        "pid": os.getpid()})
    counts = node_counts(cfg.slurm.nodes)
    nodes = counts[-1]  # a range: as many nodes as Slurm could grant on an idle cluster
    print(f"rehearsing {cfg.name} as {shape(nodes, cfg.slurm.tasks_per_node)} on this machine"
          + (f" (slurm.nodes={slurm_nodes(cfg.slurm.nodes)}: the most; --resume slurm.nodes=N "
             "continues at "
             "another count)" if len(counts) > 1 else "") + f"; run dir {run_dir}"
          + (f"; outside slurm.container ({cfg.slurm.container.runtime}: on the cluster only)"
             if cfg.slurm.container.runtime else ""), flush=True)
    try:
        code = rehearse(config_path, run_dir, nodes, cfg.slurm.tasks_per_node, job_id=job_id,
                        preempt_at=preempt_at, timeout_at=timeout_at,
                        warning_signal=signal_number(cfg.slurm.signal),
                        fail_at=fail_at or [], freeze_at=freeze_at or [])
        # a rank killed by a signal: as a shell reports it (-9 -> 137)
        code = 128 - code if code < 0 else code
    except KeyboardInterrupt:  # between attempts: the ranks are gone already
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        steps = [] if cfg.train.script else committed_steps(run_dir)
        kept = ("the script was ended (hpc_ddp commits no snapshot of a train.script: it goes on "
                "from its own "
                "checkpoint, if it saves one)" if cfg.train.script else
                f"snapshot of step {steps[0]} committed" if steps else "no snapshot committed yet")
        print(f"interrupted: {kept}; continue with:\n  {again or 'the same command with --resume'}",
              flush=True)
        return code
    ignored = _ignored_stop(run_dir, job_id)
    if code == 0 and ignored:
        code = 1  # a rehearsal that would lose the run on the cluster has not passed
    metrics = layout.metrics(run_dir)
    print(f"{_outcome(run_dir, code, ignored)}: "
          + (f"metrics in {metrics}, " if metrics.exists() else "")
          + f"logs in {run_dir / 'logs'}", flush=True)
    return code


def _outcome(run_dir: Path, code: int, ignored: dict[str, Any] | None = None) -> str:
    """How a rehearsal ended, in one word or three: a stop at a requeue cap is not a failure."""
    from hpc_ddp.rundir.ledger import REASONS_CAPPED, read_attempts

    last = (read_attempts(run_dir) or [{}])[-1]
    if code == 0:
        return "finished"
    if last.get("reason") == "finished" and not ignored:
        return ("FAILED: the run finished, but a stop it was asked to rehearse never happened (the "
                "error above)")
    if ignored:
        note = str(ignored.get("note", ""))
        why = note if note.startswith("the script") else "the loop never called run.boundary(step)"
        return (f"FAILED: {ignored['stop_ignored']} was sent but never acted on (attempt "
                f"{ignored['restart_count']}): "
                f"{why}; on a cluster this job is killed with nothing saved")
    if last.get("capped") and last.get("reason") in ("timeout", "preemption"):
        return (f"STOPPED at step {last.get('last_step')} "
                f"(slurm.{REASONS_CAPPED[last['reason']]} reached; --resume continues it)")
    from hpc_ddp.core.codes import exit_words

    return f"FAILED, {exit_words(code)}"


def _ignored_stop(run_dir: Path, job_id: int | None) -> dict[str, Any] | None:
    """This rehearsal's attempt whose loop got a stop signal and never acted on it, if any."""
    from hpc_ddp.rundir.ledger import read_attempts

    return next((a for a in read_attempts(run_dir) if a.get("stop_ignored")
                 and a.get("job_id") == job_id), None)
