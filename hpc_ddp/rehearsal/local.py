"""Rehearse a Slurm job on this machine: nodes x tasks_per_node worker processes on gloo.

Each worker gets the variables srun would give it (``simulated_environ``: a
compressed ``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE=2(x2)``, ...) with the
rendezvous pointed at loopback, and runs the same ``python -m hpc_ddp.worker``
as on the cluster. Every rank's output goes to ``RUN_DIR/logs/``; rank 0's is
also streamed here. When a rank fails, the others are ended (their whole
process groups, DataLoader workers included) and its error is shown once, with
the ranks that failed the same way (a rank declared lost, :mod:`hpc_ddp.rank.watch.liveness`,
in one line instead). Ctrl-C is passed on to every rank as SIGINT:
they stop at the next boundary with a committed snapshot (a second Ctrl-C ends
them at once). No torch in this process.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from hpc_ddp.rundir import layout
from hpc_ddp.rundir import beats, jit_offers, node_local
from hpc_ddp.rehearsal import local_warm
from hpc_ddp.rehearsal.local_end import end_ranks, wait_ranks
from hpc_ddp.rehearsal.local_report import attempt_code
from hpc_ddp.rehearsal.local_tee import tee as tee_rank_0
from hpc_ddp.rehearsal.local_inject import (KILL_DELAY_VAR, SIGNAL_SKEW_VAR, Injection,
                                            freeze_problem, injector,
                                            node_ranks, unfired)
from hpc_ddp.core.codes import DIE_AT_VAR, EXIT_INTERRUPTED, EXIT_REQUEUE, EXIT_USAGE, HOLD_AT_VAR
from hpc_ddp.core.slurm_env import IN_JOB_VAR, simulated_environ

if TYPE_CHECKING:
    from hpc_ddp.rehearsal.local_heal import LocalHealer


def free_port() -> int:
    """A port that is free on loopback right now (the kernel picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environs(nodes: int, tasks_per_node: int, *, job_id: int, restart_count: int, port: int,
                  base: Mapping[str, str], hosts: Sequence[str] | None = None,
                  cpus_per_task: int = 1) -> list[dict[str, str]]:
    """The full environment of every simulated task. Each task gets ``slurm.cpus_per_task`` as srun
    gives it (SLURM_CPUS_PER_TASK), so it runs as many intra-op threads as on the cluster
    (rank/attempt/session.py's threads): another thread count sums in another order, and the
    rehearsal would not give the cluster's bits."""
    return [{**base, **slurm, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "PYTHONUNBUFFERED": "1",
             "SLURM_CPUS_PER_TASK": str(cpus_per_task), "HPC_DDP_LOCAL": "1"}
            for slurm in simulated_environ(nodes, tasks_per_node, job_id=job_id,
                                           restart_count=restart_count,
                                           hosts=hosts)]


def script_progress(config_path: Path) -> re.Pattern[str] | None:
    """For a ``train.script`` run: the regex that finds its step in rank 0's output."""
    from hpc_ddp.core.config import load_config

    train = load_config([config_path]).train
    return re.compile(train.script_progress) if train.script else None


def cpus_per_task(config_path: Path) -> int:
    """``slurm.cpus_per_task`` of the run: each simulated task's SLURM_CPUS_PER_TASK."""
    from hpc_ddp.core.config import load_config

    return int(load_config([config_path]).slurm.cpus_per_task)


def launch(config_path: Path, run_dir: Path, nodes: int, tasks_per_node: int, *, job_id: int,
           restart_count: int = 0, events: list[tuple[int, int]] | None = None,
           stream: IO[str] = sys.stdout,
           err: IO[str] = sys.stderr, watch: dict[str, object] | None = None,
           log_index: int | None = None,
           hosts: Sequence[str] | None = None, extra_env: Mapping[str, str] | None = None,
           kills: list[Injection] | None = None, freezes: list[Injection] | None = None,
           die_at: Mapping[int, int] | None = None) -> int:
    """Run one attempt of the job; return rank 0's code (0 done, EXIT_REQUEUE stopped), else the
    failure's (``watch["failed"]``: the ranks that failed, the first one first; a rank declared lost
    comes first)."""
    logs = layout.logs(run_dir)
    logs.mkdir(parents=True, exist_ok=True)
    environs = _attempt_environs(config_path, run_dir, nodes, tasks_per_node, job_id=job_id,
                                 restart_count=restart_count, hosts=hosts, extra_env=extra_env,
                                 die_at=die_at, events=events)
    cmd = [sys.executable, "-m", "hpc_ddp.worker", "--config", str(config_path)]
    # the attempt's number in the run's ledger
    index = restart_count if log_index is None else log_index
    paths = [logs / f"attempt-{index}-rank-{rank}.log" for rank in range(len(environs))]
    procs: list[subprocess.Popen[bytes]] = []
    frozen: list[int] = []
    tee, quiet = None, threading.Event()
    try:
        _start_ranks(procs, cmd, environs, paths)
        on_step = injector(procs, events if events is not None else [], err, watch, kills,
                           skew_s=float(os.environ.get(SIGNAL_SKEW_VAR) or 0), freezes=freezes,
                           frozen=frozen,
                           kill_delay_s=float(os.environ.get(KILL_DELAY_VAR) or 0),
                           self_kill=bool(die_at))
        tee = threading.Thread(target=tee_rank_0, args=(procs[0].stdout, paths[0], stream, err,
                                                        on_step, script_progress(config_path),
                                                        watch, quiet),
                               daemon=True)
        tee.start()
        codes, failed, interrupted = wait_ranks(procs, err)
    finally:
        end_ranks(procs, frozen,
                  lambda: jit_offers.writing(run_dir, job_id, restart_count,
                                             int((extra_env or {}).get(IN_JOB_VAR) or 0)))
        if tee is not None:
            tee.join(timeout=5)
            # a pipe still held (a child that outlived rank 0): from here the tee writes its log
            # only
            quiet.set()
        if procs and procs[0].stdout is not None and (tee is None or not tee.is_alive()):
            procs[0].stdout.close()  # rank 0's pipe, read by the tee until it ended
    if interrupted:
        return EXIT_INTERRUPTED
    attempt = (run_dir, job_id, restart_count, int((extra_env or {}).get(IN_JOB_VAR) or 0))
    return attempt_code(procs, codes, failed, paths, attempt, watch, err)


def _attempt_environs(config_path: Path, run_dir: Path, nodes: int, tasks_per_node: int, *,
                      job_id: int,
                      restart_count: int, hosts: Sequence[str] | None,
                      extra_env: Mapping[str, str] | None, die_at: Mapping[int, int] | None,
                      events: list[tuple[int, int]] | None) -> list[dict[str, str]]:
    """Every rank's environment for one attempt, with what the injections ask of the ranks, and the
    run's secret read once for them all (:mod:`hpc_ddp.rundir.secret_env`)."""
    base = {**os.environ, **(extra_env or {}), **node_local.handed_secret(run_dir)}
    environs = rank_environs(nodes, tasks_per_node, job_id=job_id, restart_count=restart_count,
                             port=free_port(), base=base,
                             hosts=hosts,
                             cpus_per_task=cpus_per_task(config_path))
    # --fail-at: these ranks die after their own boundary of that step
    for rank, step in (die_at or {}).items():
        environs[rank][DIE_AT_VAR] = str(step)
    # rank 0 waits at each injected stop's step for the signal sent on reading its report
    if events:
        environs[0][HOLD_AT_VAR] = ",".join(str(step) for step, _signum in events)
    return environs


def _start_ranks(procs: list[subprocess.Popen[bytes]], cmd: list[str],
                 environs: list[dict[str, str]], paths: list[Path]) -> None:
    """Start every rank in a session of its own, appending each to ``procs`` as it starts (the
    caller ends those that started when a later one cannot); rank 0's output is a pipe (the tee
    reads it), every other rank's goes to its log."""
    for rank, env in enumerate(environs):
        out = subprocess.PIPE if rank == 0 else open(paths[rank], "ab")
        procs.append(local_warm.start(cmd, env, out))  # type: ignore[arg-type]
        if rank:
            out.close()  # type: ignore[union-attr]


def rehearse(config_path: Path, run_dir: Path, *args: Any, **kwargs: Any) -> int:
    """:func:`_rehearse`; then the simulated nodes' liveness folders on this machine (``/dev/shm``)
    go, a lost node's included, as a real node's go with it."""
    try:
        with local_warm.warm_starts(config_path):  # torch imported once, not once per rank
            return _rehearse(config_path, run_dir, *args, **kwargs)
    finally:
        shutil.rmtree(beats.run_folder(run_dir), ignore_errors=True)


def _rehearse(config_path: Path, run_dir: Path, nodes: int, tasks_per_node: int, *, job_id: int,
             preempt_at: list[int], timeout_at: list[int], warning_signal: int,
              stream: IO[str] = sys.stdout,
             err: IO[str] = sys.stderr, fail_at: Sequence[tuple[int, int | None]] = (),
             freeze_at: Sequence[tuple[int, int | None]] = ()) -> int:
    """Attempts until the run finishes or fails, as Slurm would requeue it (SLURM_RESTART_COUNT +
    1), with failed steps healed in-process first, as the batch shell heals them in the job
    (:mod:`hpc_ddp.rehearsal.local_heal`).

    ``preempt_at`` steps get SIGTERM, ``timeout_at`` steps the time-out warning signal,
    each once, sent to every rank when rank 0 has finished that step; at each ``fail_at``
    (step, node) the ranks of that simulated node are killed, at each ``freeze_at`` they are
    stopped (SIGSTOP: found by liveness, then SIGKILLed when the step ends).
    """
    from hpc_ddp.rehearsal.local_heal import LocalHealer

    events = sorted([(s, int(signal.SIGTERM)) for s in preempt_at]
                    + [(s, warning_signal) for s in timeout_at])
    healer = LocalHealer.for_config(config_path, nodes)
    problem = healer.fail_at_problem(fail_at) or freeze_problem(freeze_at, len(healer.training))
    if problem:
        err.write(f"error: {problem}\n")
        return EXIT_USAGE
    return _attempts(config_path, run_dir, tasks_per_node, healer, job_id=job_id, events=events,
                     fail_at=fail_at, freeze_at=freeze_at, stream=stream, err=err)


def _attempts(config_path: Path, run_dir: Path, tasks_per_node: int, healer: LocalHealer, *,
              job_id: int, events: list[tuple[int, int]],
              fail_at: Sequence[tuple[int, int | None]],
              freeze_at: Sequence[tuple[int, int | None]], stream: IO[str], err: IO[str]) -> int:
    """The attempts of a rehearsal whose injections were checked: each step launched, a failed one
    settled as the batch shell settles it (healed in the job, else the job requeued), until a step
    ends the run; returns its code."""
    from hpc_ddp.rehearsal.local_heal import timeline_environ
    from hpc_ddp.rehearsal.local_settle import StepEnd, settle_step
    from hpc_ddp.rundir import jit_tidy
    from hpc_ddp.rundir.ledger import attempt_tag, read_attempts

    restart = 0
    marks = lambda: (run_dir, job_id, restart)  # noqa: E731  (the attempt the kill happens in)
    kills, freezes = _injections(fail_at, freeze_at, healer, tasks_per_node, marks)
    # else B11's random points: the launcher kills, timed
    at_boundary = not os.environ.get(KILL_DELAY_VAR)
    watch: dict[str, object] = {"step": None, "line": ""}
    # a --resume rehearsal: its logs follow the earlier attempts' logs
    earlier = len(read_attempts(run_dir))
    # a finished run's requeue does nothing: no stop to rehearse
    done_before = layout.done(run_dir).exists()
    # when the last step ended, and which failed step the next heals
    steps, ended, healing = 0, None, None
    while True:
        started = round(time.time(), 3)
        # the batch shell's part of the timeline
        times = timeline_environ(run_dir, healing, ended, started)
        code = launch(config_path, run_dir, len(healer.training), tasks_per_node, job_id=job_id,
                      restart_count=restart, events=events, stream=stream, err=err, watch=watch,
                      log_index=earlier + steps, hosts=healer.training,
                      extra_env={**healer.environ(), **times},
                      kills=kills, freezes=freezes,
                      die_at=_die_at(fail_at, kills, healer, at_boundary))
        steps, ended, healing = steps + 1, round(time.time(), 3), None
        # ended before what it was to rehearse
        if code == 0 and (events or kills or freezes) and not done_before:
            err.write(unfired(events, watch, script_progress(config_path),
                              kills=[s for s, _ in kills],
                              freezes=[s for s, _ in freezes]) + "\n")
            return 1
        if code in (0, EXIT_REQUEUE):  # the batch shell settles these too: its tidying of jit/
            jit_tidy.prune(run_dir, attempt_tag(job_id, restart, healer.index))
        if code in (0, EXIT_INTERRUPTED):
            return code
        if code != EXIT_REQUEUE:  # as the batch shell does on Slurm: record it, heal or requeue it
            step = StepEnd(config_path, run_dir, job_id, restart, code, earlier + steps - 1,
                           started, times)
            requeued = settle_step(step, healer, watch, err)
            if healer.advance():
                healing = (job_id, restart, healer.index - 1)
                continue
            if not requeued:
                return code
        restart += 1
        healer.requeued()
        err.write(f"[local] attempt {earlier + steps - 1} ended; the job is requeued (requeue "
                  f"{restart}), its first "
                  f"step is attempt {earlier + steps}, as status numbers them\n")


def _injections(fail_at: Sequence[tuple[int, int | None]],
                freeze_at: Sequence[tuple[int, int | None]], healer: LocalHealer,
                tasks_per_node: int, marks: Callable[[], tuple[Path, int, int]],
                ) -> tuple[list[Injection], list[Injection]]:
    """--fail-at's kills and --freeze-at's freezes as the injector takes them: (step, what names
    the node's ranks, killing them for a kill); ``marks``: the attempt a kill happens in, at the
    kill."""
    kills = [(step, lambda node=node, step=step: healer.kill(node, marks()))
             for step, node in fail_at]
    freezes: list[Injection] = [(step, lambda node=node: node_ranks(healer.training,
                                                                    tasks_per_node, node))
                                for step, node in freeze_at]
    return kills, freezes


def _die_at(fail_at: Sequence[tuple[int, int | None]], kills: list[Injection],
            healer: LocalHealer, at_boundary: bool) -> dict[int, int]:
    """The ranks that kill themselves after their boundary of a --fail-at step (rank: step), unless
    the launcher kills them at random points (``at_boundary`` False)."""
    return {rank: step for step, node in fail_at if at_boundary
            and step in {k[0] for k in kills}
            for rank in healer.victims(node)[1]}
