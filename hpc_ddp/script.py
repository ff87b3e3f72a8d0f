"""``train.script``: an unmodified torchrun-style script as the program of every task.

The worker runs ``python SCRIPT ARGS...`` as a child with the variables a torchrun
script reads (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT), derived from
Slurm as everywhere else, plus HPC_DDP_RUN_DIR, HPC_DDP_RESTART_COUNT and
HPC_DDP_CONFIG so the script can find its own checkpoint (or open
``hpc_ddp.session()`` for an exact resume). No torchrun process is needed.

The child runs in its own session, and the worker forwards the first stop signal (the
warning signal, SIGTERM, Ctrl-C) to it; on a cluster Slurm signals every process of the
step as well, so it may get the signal twice. When the script exits after one, the
attempt is a time-out or preemption (or an interruption) and rank 0's worker records it
and requeues within the caps, as for any program (:func:`hpc_ddp.session.conclude`).
Exit 0 without a signal is a finished run; any other exit without a signal is a failure
(settled and capped as usual).

Rank 0's worker reads its script's output (:mod:`hpc_ddp.script_output`). A script that
goes on printing progress after the signal did not act on it: exit 0 then means it ran to
its end (``finished``, with ``stop_ignored`` and a note in the ledger), and a later stop
signal on a cluster (the time limit's SIGTERM, KillWait before the SIGKILL) makes rank 0
record and requeue the attempt at once, since nothing will run after the kill.

A crash on one rank reaches the others as a stop signal: srun's ``--kill-on-bad-exit``
(and the local launcher) ends them with SIGTERM, which looks like a preemption. So a
worker whose script crashed leaves a crash marker in the run dir before it exits, and a
stopped worker that finds one records the attempt as ``failed`` (capped by
``slurm.max_failures``), never as a preemption to requeue. No torch in this process:
the script imports what it needs.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp import layout
from hpc_ddp.atomic import write_atomic
from hpc_ddp.errors import HpcDdpError, explain
from hpc_ddp.preemption import (EXIT_ERROR, TICK_S, StopFlag, append_attempt, cancelled, job_spec, job_state,
                                read_attempts, recorded_error)
from hpc_ddp.runlock import acquire, release
from hpc_ddp.script_output import Progress, start_relays
from hpc_ddp.session import CONFIG_VAR, WRAPPED, Attempt, conclude
from hpc_ddp.shutdown import die_with_parent
from hpc_ddp.slurm_env import DistEnv, torch_env

log = logging.getLogger("hpc_ddp.script")
POLL_S = 0.05
CRASH_WAIT_S = 1.0  # how long a stopped rank looks for another rank's crash marker (a shared filesystem's lag)


IGNORED_HINT = ("HINT: on the signal, save and exit (docs/own-loop.md, tier 2), or raise slurm.signal_delay_s if "
                "the script saves only at an epoch end; after saving on a stop, exit non-zero: exit 0 after a "
                "signal that was not acted on means the script ran to its end")


class ScriptError(HpcDdpError):
    """train.script cannot be run (missing file)."""


def script_environ(environ: Mapping[str, str], env: DistEnv, run_dir: Path) -> dict[str, str]:
    """The child's environment: this task's, plus what torchrun would set and where the run lives."""
    return {**environ, **torch_env(env), "GROUP_RANK": str(env.node_rank), "GROUP_WORLD_SIZE": str(env.num_nodes),
            "ROLE_RANK": str(env.rank), "ROLE_WORLD_SIZE": str(env.world_size),
            "TORCHELASTIC_RESTART_COUNT": str(env.restart_count), "HPC_DDP_RUN_DIR": str(run_dir),
            "HPC_DDP_RESTART_COUNT": str(env.restart_count), CONFIG_VAR: str(layout.config(run_dir)),
            WRAPPED: "1"}


def script_path(script: str) -> Path:
    path = Path(script)
    if not path.is_file():
        raise ScriptError(explain(f"train.script={script} does not exist (looked in {Path.cwd()})",
                                  hint="give a path relative to the directory you submit from (jobs start "
                                  "there), or an absolute one"), key="train.script")
    return path


def supervise(cmd: list[str], environ: Mapping[str, str], flag: StopFlag, progress: Progress | None = None,
              on_later_stop: Callable[[], None] | None = None) -> int:
    """Run the child to its end, forwarding the first stop signal this process receives; its exit code.

    With ``progress`` (rank 0), the child's output comes through pipes and is read for progress lines.
    ``on_later_stop`` is called once if another stop signal arrives while the child still runs after
    the first: Slurm's SIGTERM at the time limit, which the worker does not outlive by more than KillWait.
    """
    pipe = subprocess.PIPE if progress is not None else None
    child = subprocess.Popen(cmd, env=dict(environ), start_new_session=True, preexec_fn=die_with_parent,
                             stdout=pipe, stderr=pipe)
    relays = [] if progress is None else start_relays(
        [(child.stdout, sys.stdout.buffer), (child.stderr, sys.stderr.buffer)], progress)  # type: ignore[list-item]
    seen, warned = 0, False
    while child.poll() is None:
        if flag.count > seen and flag.signum is not None:
            if not seen:
                log.info("forwarding %s to the script", signal.Signals(flag.signum).name)
                child.send_signal(flag.signum)
                if progress is not None:
                    progress.stop_forwarded()
            elif on_later_stop is not None:
                on_later_stop()
                on_later_stop = None
            seen = flag.count
        if progress is not None and progress.ignored and not warned:
            warned = True
            log.warning("%s, so it took no snapshot of its own at the signal; on a cluster it is killed at the "
                        "time limit or the end of the grace period. %s", progress.went_on(
                            signal.Signals(flag.signum or signal.SIGTERM).name), IGNORED_HINT)
        time.sleep(POLL_S)
    for relay in relays:
        relay.join(timeout=5)
    return int(child.returncode)


def wait_for_ledger(attempt: Attempt, timeout_s: float = 60.0) -> dict[str, Any] | None:
    """A stopped rank other than 0 leaves only once rank 0 has recorded the attempt (and requeued).

    There is no process group among the workers of a script (the script has its own), so
    no closing barrier: without this wait, the first rank to exit with EXIT_REQUEUE would
    make srun's --kill-on-bad-exit end rank 0 while it writes the ledger. Returns rank 0's line
    (it may say ``finished``: the scripts ignored the signal and ran to their end), or None.
    """
    deadline = time.monotonic() + timeout_s
    mine = (attempt.env.job_id, attempt.env.restart_count)
    while time.monotonic() < deadline:
        for line in read_attempts(attempt.run_dir):
            if (line.get("job_id"), line.get("restart_count")) == mine:
                return line
        time.sleep(0.2)
    return None


def crash_path(run_dir: Path, env: DistEnv) -> Path:
    return layout.errors(run_dir) / f"job-{env.job_id}-restart-{env.restart_count}-crash-rank-{env.rank}.txt"


def mark_crash(attempt: Attempt, path: Path, code: int) -> None:
    """Before this worker exits 1 (and srun ends the other tasks): say which rank's script crashed."""
    marker = crash_path(attempt.run_dir, attempt.env)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(marker, f"train.script {path} exited with code {code} on rank {attempt.env.rank}\n")
    except OSError:
        pass  # an unwritable run dir: the error is printed all the same


def crashes(attempt: Attempt, wait_s: float = CRASH_WAIT_S) -> list[str]:
    """What other ranks' crash markers of this attempt say; waits up to ``wait_s`` for one to appear."""
    env, deadline = attempt.env, time.monotonic() + wait_s
    pattern = f"job-{env.job_id}-restart-{env.restart_count}-crash-rank-*.txt"
    while True:
        found = sorted(layout.errors(attempt.run_dir).glob(pattern))
        if found or time.monotonic() >= deadline:
            return [p.read_text().strip() for p in found]
        time.sleep(0.1)


def record_crash(attempt: Attempt, crashed: list[str]) -> int:
    """The attempt failed on another rank: rank 0 writes the one ``failed`` line (the settle step caps and
    requeues it by slurm.max_failures); nobody requeues it as a stop."""
    if attempt.env.is_main:
        append_attempt(attempt.run_dir, {**attempt.record, "reason": "failed", "exit_code": 1,
                                         "message": f"{crashed[0]}; the other ranks were ended by the job step"})
    log.error("%s: this rank's script was ended because of it; the attempt is a failure (slurm.max_failures), "
              "not a stop", crashed[0])
    return 1


def script_args(attempt: Attempt) -> list[str]:
    """train.args, and train.resume_args when this attempt continues the run (the ledger has an earlier one)."""
    train = attempt.cfg.train
    if attempt.attempts and train.resume_args:
        if attempt.env.is_main:
            log.info("this attempt continues the run: appending train.resume_args %s", train.resume_args)
        return [*train.args, *train.resume_args]
    return list(train.args)


def _watch(attempt: Attempt) -> Progress | None:
    """Rank 0 reads its script's output for progress lines (train.script_progress); the others do not."""
    pattern = attempt.cfg.train.script_progress
    return Progress(re.compile(pattern)) if attempt.env.is_main and pattern else None


def _later_stop(attempt: Attempt, progress: Progress | None, outcome: dict[str, int]) -> Callable[[], None]:
    """On a cluster: a second stop signal while the script still runs after the first one was forwarded
    means Slurm is ending the job (the time limit's SIGTERM; KillWait later, SIGKILL). Rank 0 records the
    attempt now, saying that the script did not act on the stop, and requeues it within the caps: a script
    that also saves on its own (every N steps) goes on from there."""
    def record() -> None:
        flag = attempt.flag
        first, now = signal.Signals(flag.signum or signal.SIGTERM).name, signal.Signals(flag.last or 15).name
        went = progress.went_on(first) if progress is not None and progress.ignored else \
            f"the script did not act on {first}"
        waited = time.time() - (flag.received_at or time.time())
        note = (f"{went}; it was still running when {now} came {waited:.0f} s later, and Slurm kills it with "
                "nothing saved since its own last checkpoint")
        attempt.record.update(stop_ignored=first, note=note, end=round(time.time(), 3),
                              **({"last_step": progress.step} if progress is not None and progress.step else {}))
        log.error("%s. %s", note, IGNORED_HINT)
        if flag.last == signal.SIGTERM and _cancelled_now(attempt):
            append_attempt(attempt.run_dir, {**attempt.record, "reason": "cancelled"})
            outcome["code"] = 0
        else:
            outcome["code"] = conclude(attempt, stopped=True, step=None)
    return record


def _cancelled_now(attempt: Attempt) -> bool:
    """The later SIGTERM is scancel's (never requeue), not the time limit's: both leave the job COMPLETING
    (measured on 22.05), but only the time limit comes at the job's end."""
    at_end = attempt.end_time is not None and time.time() >= attempt.end_time - TICK_S
    return not at_end and cancelled(signal.SIGTERM, job_state(job_spec(attempt.environ)))


def _ran_to_its_end(attempt: Attempt, progress: Progress | None, code: int) -> bool:
    """The script went on after the stop it was sent and exited 0: it finished, it did not stop."""
    if code != 0 or progress is None or not progress.ignored:
        return False
    first = signal.Signals(attempt.flag.signum or signal.SIGTERM).name
    note = f"{progress.went_on(first)} and exited 0: recorded as finished, not as a stop"
    attempt.record.update(stop_ignored=first, note=note)
    log.warning("%s. %s", note, IGNORED_HINT)
    return True


def run_script(attempt: Attempt) -> int:
    """One attempt of a ``train.script`` run on this rank; returns this rank's exit code."""
    cfg, env = attempt.cfg, attempt.env
    path = script_path(cfg.train.script)
    if env.is_main:
        acquire(attempt.run_dir, attempt.holder)
    try:
        if attempt.local and env.is_main:
            from hpc_ddp.local import PROGRESS_MARK

            print(f"{PROGRESS_MARK}0", flush=True)  # "started": --preempt-at 0 may fire now
        progress, later = _watch(attempt), {}
        environ = script_environ(attempt.environ, env, attempt.run_dir)
        if progress is not None:
            environ.setdefault("PYTHONUNBUFFERED", "1")  # lines as they are printed, not in 8 KiB blocks
        code = supervise([sys.executable, str(path), *script_args(attempt)], environ, attempt.flag, progress,
                         None if attempt.local or not env.is_main else _later_stop(attempt, progress, later))
        attempt.record.update(end=round(time.time(), 3), script_exit_code=code)
        if progress is not None and progress.step is not None:
            attempt.record["last_step"] = progress.step  # the script's own step, as its last progress line said
        if "code" in later:
            return later["code"]  # recorded (and requeued) when Slurm's later signal came
        if attempt.flag.is_set and not _ran_to_its_end(attempt, progress, code):
            crashed = crashes(attempt) if code != 0 else []
            if crashed:
                return record_crash(attempt, crashed)
            if not env.is_main:
                line = wait_for_ledger(attempt)
                if line is not None and line.get("reason") == "finished":
                    return 0  # rank 0's script went on after the signal and ran to its end
            return conclude(attempt, stopped=True, step=None)
        if code == 0:
            if env.is_main and not layout.done(attempt.run_dir).exists():
                write_atomic(layout.done(attempt.run_dir), json.dumps(
                    {"script": str(path), "world_size": env.world_size, "exit_code": 0}))
            return conclude(attempt, stopped=False, step=None)
        if recorded_error(attempt.run_dir, env.job_id, env.restart_count):
            return EXIT_ERROR  # the script's hpc_ddp.session() recorded a deterministic error
        mark_crash(attempt, path, code)
        print(f"error: train.script {path} exited with code {code} on rank {env.rank} without a stop signal: "
              "a failure (requeued only within slurm.max_failures); its output is above", file=sys.stderr, flush=True)
        return 1
    finally:
        if env.is_main:
            release(attempt.run_dir, attempt.holder)
