"""``train.script``: an unmodified torchrun-style script as the program of every task.

The worker runs ``python SCRIPT ARGS...`` as a child with the variables a torchrun
script reads (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT), derived from
Slurm as everywhere else, plus HPC_DDP_RUN_DIR, HPC_DDP_RESTART_COUNT and
HPC_DDP_CONFIG so the script can find its own checkpoint (or open
``hpc_ddp.session()`` for an exact resume), and the config's ``user:`` section as
``HPC_DDP_USER_<KEY>`` variables (:mod:`hpc_ddp.core.user_settings`). No torchrun process is needed.

The child runs in its own session, and the worker forwards the first stop signal (the
warning signal, SIGTERM, Ctrl-C) to it; on a cluster Slurm signals every process of the
step as well, so it may get the signal twice. When the script exits after one, the
attempt is a time-out or preemption (or an interruption) and rank 0's worker records it
and requeues within the caps, as for any program (:func:`hpc_ddp.rank.attempt.conclude.conclude`).
Exit 0 without a signal is a finished run; any other exit without a signal is a failure
(settled and capped as usual). The child process itself (started in its own session, the stop
forwarded, a hung one ended) is :mod:`hpc_ddp.rank.script.child`'s.

Rank 0's worker reads its script's output (:mod:`hpc_ddp.rank.script.output`). A script that
goes on printing progress after the signal did not act on it: exit 0 then means it ran to
its end (``finished``, with ``stop_ignored`` and a note in the ledger), and a later stop
signal on a cluster (the time limit's SIGTERM, KillWait before the SIGKILL) makes rank 0
record and requeue the attempt at once, since nothing will run after the kill. A script
that, after its second progress line, prints none for ``dist.timeout_s`` (or 3 x its longest
gap so far, if longer) is hung: rank 0 records ``hung`` and ends it.

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
import sys
import time
from collections.abc import Mapping
from typing import Any
from pathlib import Path

from hpc_ddp.rundir import layout
from hpc_ddp.core.errors import HpcDdpError, explain
from hpc_ddp.core.codes import EXIT_ERROR
from hpc_ddp.rundir.ledger import recorded_error
from hpc_ddp.rundir.runlock import acquire, release
from hpc_ddp.rank.script.child import supervise
from hpc_ddp.rank.script.outcome import (crashes, exited_early, hung, later_stop, mark_crash,
                                         mark_stop, prepare_marks, ran_to_its_end, record_crash,
                                         stopped_late, wait_for_ledger)
from hpc_ddp.rank.stop.shield import STOP_SIGNALS_VAR, stop_signals
from hpc_ddp.rank.script.output import Progress
from hpc_ddp.rank.script.publish import Publisher
from hpc_ddp.rank.attempt.context import CONFIG_VAR, WRAPPED, Attempt
from hpc_ddp.rank.attempt.conclude import conclude
from hpc_ddp.rank.attempt.injection import print_progress
from hpc_ddp.rank.group import nccl_report
from hpc_ddp.rank.metrics import timeline
from hpc_ddp.core.slurm_env import DistEnv, torch_env
from hpc_ddp.rank.loop.compiling import apply_cache_env
from hpc_ddp.core.user_settings import PREFIX as USER_PREFIX, user_environ

log = logging.getLogger("hpc_ddp.script")
RESUME_NOTE = ("A stop and a requeue are only as exact as that checkpoint (what it saves and how "
               "often); hpc_ddp forwards the signal, records and requeues the attempt, and writes "
               "no model.pt or params_sha256 for it. A script that opens hpc_ddp.session() gets "
               "both, and a resume exact to the step (docs/own-loop.md)")


def resume_note(resume_args: list[str]) -> str:
    """What rank 0 says at the start of every attempt: how the script resumes, truthfully (hpc_ddp
    does not know whether it will; the first progress line tells,
    :func:`hpc_ddp.rank.script.publish.started_over`)."""
    how = (f"on a continued attempt hpc_ddp appends train.resume_args {resume_args}" if resume_args
           else "train.resume_args is not set, so hpc_ddp tells it nothing and it resumes only if "
           "it looks for its checkpoint by itself (nanoGPT needs train.resume_args: "
           "['--init_from=resume'])")
    return (f"train.script: the script resumes from its own checkpoint if it finds one; {how}. "
            f"{RESUME_NOTE}")


class ScriptError(HpcDdpError):
    """train.script cannot be run (missing file)."""


def script_environ(environ: Mapping[str, str], env: DistEnv, run_dir: Path,
                   user: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The child's environment: this task's, plus what torchrun would set, where the run lives, and
    the config's user section as HPC_DDP_USER_* (:mod:`hpc_ddp.core.user_settings`; none left from
    the submitting shell)."""
    kept = {k: v for k, v in environ.items() if not k.startswith(USER_PREFIX)}
    return {**kept, **user_environ(user or {}), **torch_env(env), "GROUP_RANK": str(env.node_rank),
            "GROUP_WORLD_SIZE": str(env.num_nodes),
            "ROLE_RANK": str(env.rank), "ROLE_WORLD_SIZE": str(env.world_size),
            "TORCHELASTIC_RESTART_COUNT": str(env.restart_count + env.in_job),
            "HPC_DDP_RUN_DIR": str(run_dir),
            "HPC_DDP_RESTART_COUNT": str(env.restart_count),
            CONFIG_VAR: str(layout.config(run_dir)),
            WRAPPED: "1"}


def script_path(script: str) -> Path:
    path = Path(script)
    if not path.is_file():
        raise ScriptError(explain(f"train.script={script} does not exist (looked in {Path.cwd()})",
                                  hint="give a path relative to the directory you submit from "
                                       "(jobs start there), or an absolute one"),
                          key="train.script")
    return path


def script_args(attempt: Attempt) -> list[str]:
    """train.args, and train.resume_args when this attempt continues the run (the ledger has an
    earlier one)."""
    train = attempt.cfg.train
    if attempt.attempts and train.resume_args:
        if attempt.env.is_main:
            log.info("this attempt continues the run: appending train.resume_args %s",
                     train.resume_args)
        return [*train.args, *train.resume_args]
    return list(train.args)


def _watch(attempt: Attempt) -> Progress | None:
    """Rank 0 reads its script's output for progress lines (train.script_progress) and its last line
    (a script that exits 0 at once: :func:`exited_early`); the others do not."""
    pattern = attempt.cfg.train.script_progress
    return Progress(re.compile(pattern) if pattern else None) if attempt.env.is_main else None


def _nccl_capture(attempt: Attempt, environ: dict[str, str]) -> str | None:
    """Rank 0 of a GPU script across nodes: its child's NCCL writes its INIT/NET lines where the
    worker reads them when the script ends (rank/group/nccl_report.py), whether the script uses
    hpc_ddp.session() or not."""
    cfg, env = attempt.cfg, attempt.env
    if (cfg.slurm.gpus_per_node <= 0 or cfg.dist.backend == "gloo"
            or not nccl_report.wanted("nccl", env)):
        return None
    return nccl_report.prepare(environ, env, user=cfg.dist.nccl_env)


def _stopped(attempt: Attempt, code: int) -> int:
    """This rank's code when the stop came before the script ran to its end: a crash of a peer's
    script is recorded as such; a rank other than 0 follows rank 0's ledger line."""
    crashed = crashes(attempt) if code != 0 else []
    if crashed:
        return record_crash(attempt, crashed)
    if not attempt.env.is_main:
        line = wait_for_ledger(attempt)
        if line is not None and line.get("reason") == "finished":
            return 0  # rank 0's script went on after the signal and ran to its end
        if line is not None and line.get("reason") in ("hung", "failed"):
            return 1  # ended because rank 0's script hung or failed: rank 0's line says so
    return conclude(attempt, stopped=True, step=None)


def _finished(attempt: Attempt, path: Path, progress: Progress | None, publisher: Publisher | None,
              ran_s: float) -> int:
    """The script ran to its end (exit 0): the ledger's finished line, then (rank 0) DONE.json with
    its step and what it warned of."""
    env = attempt.env
    early = exited_early(attempt, progress, ran_s)
    # the ledger's finished line, then DONE.json
    result = conclude(attempt, stopped=False, step=None)
    warnings = [*(publisher.warnings if publisher is not None else []), *([early] if early else [])]
    if env.is_main:
        layout.publish_done(attempt.run_dir, json.dumps(
            {"script": str(path), "world_size": env.world_size, "exit_code": 0,
             **({"step": progress.step} if progress is not None and progress.step is not None
                else {}),
             **({"warnings": warnings} if warnings else {})}))
    return result


def run_script(attempt: Attempt) -> int:
    """One attempt of a ``train.script`` run on this rank; returns this rank's exit code."""
    cfg, env = attempt.cfg, attempt.env
    path = script_path(cfg.train.script)
    if env.is_main:
        acquire(attempt.run_dir, attempt.holder,
                predecessor=str(env.chained_from) if env.chained_from else None)
    try:
        # before the script can crash or be stopped: peers read the marks by name
        prepare_marks(attempt)
        if attempt.local and env.is_main:
            print_progress(0)  # "started": --preempt-at 0 may fire now
        progress, decided = _watch(attempt), {}
        publisher = Publisher(attempt, progress) if progress is not None else None
        environ = _child_environ(attempt, progress)
        if env.is_main:
            log.info("%s", resume_note(list(cfg.train.resume_args or [])))
        nccl, started = _nccl_capture(attempt, environ), time.monotonic()
        # a script's timeline: the worker starts it now (publish.py marks first_step)
        timeline.mark("imported")
        code = supervise([sys.executable, str(path), *script_args(attempt)], environ, attempt.flag,
                         progress,
                         None if attempt.local or not env.is_main
                         else later_stop(attempt, progress, decided),
                         cfg.dist.timeout_s,
                         None if progress is None else hung(attempt, progress, decided),
                         before_forward=lambda: mark_stop(attempt),
                         on_poll=None if publisher is None else publisher.poll)
        _record_end(attempt, code, nccl, progress, publisher)
        if "code" in decided:
            # recorded when Slurm's later signal came (and requeued), or hung
            return decided["code"]
        return _ended(attempt, path, code, progress, publisher, started)
    finally:
        if env.is_main:
            release(attempt.run_dir, attempt.holder)


def _child_environ(attempt: Attempt, progress: Progress | None) -> dict[str, str]:
    """The script's environment (:func:`script_environ`), with its torch.compile caches and, where
    rank 0 reads its output, unbuffered."""
    cfg, env = attempt.cfg, attempt.env
    environ = script_environ(attempt.environ, env, attempt.run_dir, cfg.user)
    # the script's torch.compile caches
    environ.update(apply_cache_env(cfg, env, attempt.environ).exported)
    if progress is not None:
        # lines as they are printed, not in 8 KiB blocks
        environ.setdefault("PYTHONUNBUFFERED", "1")
    return environ


def _record_end(attempt: Attempt, code: int, nccl: str | None, progress: Progress | None,
                publisher: Publisher | None) -> None:
    """The attempt's record when the script has exited: its exit code, the timeline, what its NCCL
    chose, the last progress published and the script's own last step."""
    attempt.record.update(end=round(time.time(), 3), script_exit_code=code,
                          **timeline.ledger_field(attempt.environ, attempt.attempts,
                                                  attempt.env.in_job))
    # what the script's NCCL chose
    if nccl is not None and nccl_report.collect(nccl, pid=None) is not None:
        attempt.record["nccl_net"] = dict(nccl_report.FOUND or {})
    if publisher is not None:
        publisher.poll(final=True)
    if progress is not None and progress.step is not None:
        # the script's own step, as its last progress line said
        attempt.record["last_step"] = progress.step


def _ended(attempt: Attempt, path: Path, code: int, progress: Progress | None,
           publisher: Publisher | None, started: float) -> int:
    """This rank's exit code for a script that exited with ``code`` (nothing decided before): a
    stop, a finish, a deterministic error the script's session recorded, or a crash."""
    cfg, env = attempt.cfg, attempt.env
    if -code in stop_signals({STOP_SIGNALS_VAR: cfg.slurm.signal}):
        # Slurm signals the script too: it may die of the stop before this worker forwards it,
        # and the peers' scripts die of the broken collective before their own signal comes
        mark_stop(attempt, -code)
    if code != 0 and not attempt.flag.is_set:
        # a peer's script may have died of the stop before it reached this rank
        stopped_late(attempt, code)
    if attempt.flag.is_set and not ran_to_its_end(attempt, progress, code):
        return _stopped(attempt, code)
    if code == 0:
        return _finished(attempt, path, progress, publisher, time.monotonic() - started)
    if recorded_error(attempt.run_dir, env.job_id, env.restart_count, env.in_job):
        return EXIT_ERROR  # the script's hpc_ddp.session() recorded a deterministic error
    mark_crash(attempt, path, code)
    print(f"error: train.script {path} exited with code {code} on rank {env.rank} without a stop "
          "signal: a failure (requeued only within slurm.max_failures); its output is above",
          file=sys.stderr, flush=True)
    return 1
