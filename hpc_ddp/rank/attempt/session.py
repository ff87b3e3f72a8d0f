"""Opening and closing one attempt of a run, around whatever program trains.

Open: threads, the process group, the run dir's lock (rank 0 takes it, every rank
learns the answer), the hang watchdog, the checkpointer, and the public
:class:`~hpc_ddp.rank.loop.run.Run` handed to the program (our Trainer, your ``train.loop``
function, or the body of ``with hpc_ddp.session() as run:``). Close
(:func:`hpc_ddp.rank.attempt.conclude.close`): rank 0 writes the ledger line and requeues a
stopped job (within the caps), and every rank gets its exit code. One implementation for every
kind of program. This module composes; what a rank does after a failure is
:mod:`hpc_ddp.rank.attempt.failure`'s, and the rehearsal's hooks are
:mod:`hpc_ddp.rank.attempt.injection`'s. The environment is passed in (only
:mod:`hpc_ddp.worker` reads ``os.environ``); torch is imported when a session opens.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import multiprocessing.forkserver
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.rank.attempt import failure, injection, node_shared
from hpc_ddp.rank.attempt.conclude import close, line_at_stop, note, note_ignored_stop
from hpc_ddp.rank.attempt.context import Attempt
from hpc_ddp.rank.metrics import timeline
from hpc_ddp.rank.stop.broken_step import marker
from hpc_ddp.rank.stop.shield import FORKSERVER_PRELOAD, STOP_SIGNALS_VAR, at_exit_kill_workers
from hpc_ddp.rundir import flight, jit_files, store_moved
from hpc_ddp.core.config import RunConfig, to_yaml
from hpc_ddp.core.config.diff import flat_values
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.run_dir_mode import make_run_dir
from hpc_ddp.rundir.ledger import attempt_tag, recorded_error
from hpc_ddp.rundir.runlock import RunLockedError, acquire, release
from hpc_ddp.core.slurm_env import DistEnv

if TYPE_CHECKING:
    import torch

    from hpc_ddp.rank.loop.run import Run
    from hpc_ddp.rank.watch.watchdog import Watchdog

log = logging.getLogger("hpc_ddp.session")
# "shared": control traffic on a gloo training group (tests only)
CONTROL_GROUP_VAR = "HPC_DDP_CONTROL_GROUP"


def config_hash(cfg: RunConfig) -> str:
    """Recorded in every snapshot manifest: which config wrote it."""
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]


def threads(environ: Mapping[str, str], env: DistEnv) -> None:
    """Intra-op threads: OMP_NUM_THREADS if set, else SLURM_CPUS_PER_TASK, else this node's CPUs
    shared among its tasks. torch's default (all cores in every process) oversubscribes: 10x
    slower for 2 tasks on 2 cores (measured)."""
    import torch

    if "OMP_NUM_THREADS" in environ:
        return
    cpus = environ.get("SLURM_CPUS_PER_TASK", "")
    count = (int(cpus) if cpus.isdigit() and int(cpus) > 0
             else len(os.sched_getaffinity(0)) // env.local_world_size)
    torch.set_num_threads(max(1, count))


@contextlib.contextmanager
def open_run(attempt: Attempt) -> Iterator[Run]:
    """``with open_run(attempt) as run: program(run)``; afterwards ``attempt.code`` is this rank's
    exit code.

    An exception from the program propagates (the worker records and reports it); the
    process group is torn down on every exit path.
    """
    from hpc_ddp.rank.group.distributed import default_store, from_main, process_group
    from hpc_ddp.rank.loop.misuse import LoopIgnoredStop
    from hpc_ddp.rank.watch.watchdog import Watchdog

    timeline.reset()
    started = timeline.process_start()  # the step reached this node and its Python began
    if started is not None:
        timeline.mark("started", started)
    # torch and hpc_ddp's rank code are loaded (the heal timeline, core/timeline.py)
    timeline.mark("imported")
    cfg, env = attempt.cfg, attempt.env
    _prepare(attempt)
    with beating(attempt), process_group(env, cfg.dist, **_group_options(attempt)) as device:
        _group_ready(attempt, device)
        if not attempt.wrapped:
            lock(attempt.run_dir, attempt.holder, env, from_main)
        try:
            watchdog = Watchdog(cfg.dist.timeout_s, env.rank, env.world_size,
                                store=default_store(attempt.token),
                                on_hang=failure.on_hang(attempt, cfg.dist.timeout_s)).start()
            run: Run | None = None
            try:
                run = _new_run(attempt, device, watchdog)
                try:
                    yield run
                # the stop snapshot is committed: end the attempt as that stop
                except LoopIgnoredStop as err:
                    log.error("%s", err)
                    note(attempt, "the loop went on after run.boundary returned True")
                    run.step = (run.checkpointer.last_step if run.checkpointer is not None
                                else run.step)
                except HpcDdpError:
                    # the program's own error (explained): it fails the same way after any resume
                    raise
                # a collective failed (a peer died), or the program crashed
                except Exception as err:
                    # raises StoppedMidStep if a stop broke the step
                    failure.after_exception(attempt, run, err)
                    raise
                if not run.stopped:
                    run.finish()  # a loop that returned without a stop has finished (idempotent)
                    note_ignored_stop(attempt, run)
            finally:
                if run is not None:
                    run.close_metrics()
                watchdog.stop()
            close(attempt, run)
        finally:
            if env.is_main and not attempt.wrapped:
                release(attempt.run_dir, attempt.holder)


def _prepare(attempt: Attempt) -> None:
    """Before the rendezvous: this process's threads, compile caches and loader workers; rank 0
    makes the run dir where no submit made it, and each node's first rank the node's file of
    survivors' offers."""
    from hpc_ddp.rank.loop.compiling import apply_cache_env
    from hpc_ddp.rundir import newest

    cfg, env, environ = attempt.cfg, attempt.env, attempt.environ
    threads(environ, env)
    # before torch._inductor reads them (the first optimizer or DDP imports it)
    apply_cache_env(cfg, env, environ)
    # DataLoader workers from a forkserver (our Trainer's, and a loop's that asks for one) are
    # forked from a server that has imported torch once: each epoch's new workers then start in ms,
    # not an import each. The server ignores the stop signals (its workers exit when it dies); the
    # workers' worker_init learns the run's warning signal from the environment they inherit
    # (hpc_ddp.rank.stop.shield).
    multiprocessing.forkserver.set_forkserver_preload(["torch", FORKSERVER_PRELOAD])
    os.environ[STOP_SIGNALS_VAR] = cfg.slurm.signal
    # a script's normal exit must not wait for loader workers that ignore SIGTERM
    at_exit_kill_workers()
    # before the rendezvous: no node looks for it before it exists
    if env.is_main and not attempt.wrapped:
        try:
            # made here when no submit made it: closed to others
            make_run_dir(attempt.run_dir, cfg.run_dir_mode)
            newest.create(attempt.run_dir)
        # a full or read-only run dir fails where it matters, with its own message
        except OSError as err:
            log.warning("could not create %s (%s)", newest.path(attempt.run_dir), err)
    if env.is_main and not attempt.wrapped and env.world_size > 1:  # read by content, by name
        jit_files.prepare_mark(marker(attempt.run_dir, env))
    if not attempt.wrapped:  # the node's ranks check they share its folder (node_shared.agree)
        node_shared.leave_mark(attempt.run_dir, env)
    if env.is_node_main and not attempt.wrapped and cfg.snapshot.jit and env.world_size > 1:
        # the node's file, before anyone reads it
        jit_files.prepare(jit_files.post_for(attempt.run_dir, env))


def _group_options(attempt: Attempt) -> dict[str, Any]:
    """``process_group``'s keywords for this attempt: where a peer's recorded error and the flight
    recorder's dumps are, whether control traffic gets its own group, and how rank 0 says it left a
    taken port."""
    env = attempt.env
    ids = (attempt.run_dir, env.job_id, env.restart_count, env.in_job)
    tag = attempt_tag(env.job_id, env.restart_count, env.in_job)
    # tests: the control traffic on a gloo training group
    shared = attempt.environ.get(CONTROL_GROUP_VAR) == "shared"
    return {"peer_error": functools.partial(recorded_error, *ids), "dumps": flight.prefix(*ids),
            "own_control_group": False if shared else None,
            "store_moves": (functools.partial(store_moved.announced, attempt.run_dir, tag),
                            functools.partial(store_moved.announce, attempt.run_dir, tag))}


def _group_ready(attempt: Attempt, device: torch.device) -> None:
    """Every rank is past the rendezvous: liveness listens for declarations, and rank 0 logs the
    group and keeps, for the ledger, which network NCCL chose between nodes."""
    import torch.distributed as dist

    from hpc_ddp.rank.group import control, nccl_report
    from hpc_ddp.rank.group.distributed import default_store
    from hpc_ddp.rank.watch import net_exchange

    env = attempt.env
    timeline.mark("group_ready")
    if not attempt.wrapped:
        node_shared.agree(attempt.run_dir, env)
    if attempt.liveness is not None:
        # every rank is past the rendezvous: rank 0 created the declaration's file
        attempt.liveness.listen()
        # the watchers ping each other from now on, not once the file server shows their beats
        net_exchange.start(default_store(attempt.token), attempt.liveness)
    log.info("process group: backend %s, world size %d, device %s, control traffic on %s",
             dist.get_backend(),
             env.world_size, device, "its own gloo group" if control.group() is not None
             else "the same group")
    if env.is_main and nccl_report.FOUND is not None:
        attempt.record["nccl_net"] = dict(nccl_report.FOUND)


def _new_run(attempt: Attempt, device: torch.device, watchdog: Watchdog) -> Run:
    """The run handed to the program, with what it calls back: the rehearsal's hooks after each step
    (rank/attempt/injection.py), the ledger line at the agreed stop, and what a failure sets off
    (rank/attempt/failure.py); its nodes' health checked (rank/attempt/health.py)."""
    from hpc_ddp.core.batching import replace_problem
    from hpc_ddp.rank.loop.run import Run
    from hpc_ddp.rank.state.checkpointer import Checkpointer

    cfg, env = attempt.cfg, attempt.env
    checkpointer = Checkpointer(attempt.run_dir, cfg.snapshot, env, config_hash(cfg),
                                config=flat_values(cfg),
                                local=attempt.local)
    run = Run(cfg, env, device, checkpointer=checkpointer, stop=attempt.flag, beat=watchdog.beat)
    run.on_step = injection.on_step(attempt, run)
    failure.wire(attempt, run)
    run.on_stop = functools.partial(line_at_stop, attempt, run)
    run.pace.record = attempt.record  # rank 0's slow nodes go into the attempt's ledger line
    if cfg.slurm.straggler.action == "replace":  # why a slow node cannot be left out ("": it can)
        run.pace.replace = replace_problem(cfg.slurm)
    if cfg.slurm.health.checks != "off":  # sick nodes kept out, before the program's first step
        from hpc_ddp.rank.attempt import health

        health.check(attempt, run, device)
    return run


@contextlib.contextmanager
def beating(attempt: Attempt) -> Iterator[None]:
    """This rank's liveness beats (:mod:`hpc_ddp.rank.watch.liveness`) for the attempt, from before
    the rendezvous (a node that freezes in it is found too) to after the closing barrier; the last
    beat says it left, on every way out. A wrapped script's own session does not beat: the worker
    that started it does. How a rank exits when its thread finds a peer lost or hears so is
    :mod:`hpc_ddp.rank.attempt.failure`'s."""
    from hpc_ddp.rank.watch import liveness_start

    attempt.liveness = None if attempt.wrapped else liveness_start.start(
        attempt.run_dir, attempt.cfg.dist, attempt.env, attempt.environ, on_lost=failure.exit_lost,
        on_heard=failure.exit_heard)
    try:
        yield
    finally:
        if attempt.liveness is not None:
            attempt.liveness.leave()


def lock(run_dir: Path, me: dict[str, Any], env: DistEnv,
         from_main: Callable[[str | None], str | None]) -> None:
    """Rank 0 takes the run dir's lock; every rank learns whether it could, and raises rank 0's
    error word for word: whichever rank's message reaches the user first names the job that holds
    the run dir."""
    problem: HpcDdpError | None = None
    if env.is_main:
        try:
            acquire(run_dir, me, predecessor=str(env.chained_from) if env.chained_from else None)
        except HpcDdpError as err:
            problem = err
    kind = "locked" if isinstance(problem, RunLockedError) else "error"
    shared = from_main(None if problem is None else f"{kind}:{problem}")
    if problem is not None:
        raise problem
    if shared is not None:
        kind, _, message = shared.partition(":")
        raise (RunLockedError if kind == "locked" else HpcDdpError)(message, key="run_dir")
