"""Opening and closing one attempt of a run, around whatever program trains.

Open: threads, the process group, the run dir's lock (rank 0 takes it, every rank
learns the answer), the hang watchdog, the checkpointer, and the public
:class:`~hpc_ddp.rank.loop.run.Run` handed to the program (our Trainer, your ``train.loop``
function, or the body of ``with hpc_ddp.session() as run:``). Close: rank 0 writes
the ledger line and requeues a stopped job (within the caps), and every rank gets its
exit code. One implementation for every kind of program. The environment is passed
in (only :mod:`hpc_ddp.worker` reads ``os.environ``); torch is imported when a
session opens.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import multiprocessing.forkserver
import os
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.rank.stop.broken_step import StoppedMidStep, marker, stop_came_first
from hpc_ddp.rank.attempt.conclude import conclude, end_as_stop, write_line
from hpc_ddp.rank.attempt.context import Attempt
from hpc_ddp.rank.metrics import timeline
from hpc_ddp.rank.stop.shield import FORKSERVER_PRELOAD, STOP_SIGNALS_VAR, at_exit_kill_workers
from hpc_ddp.rundir import compile_cache, flight, layout, losses, store_moved
from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.core.config import RunConfig, flat_values, to_yaml
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.run_dir_mode import make_run_dir
from hpc_ddp.rundir.ledger import append_attempt, attempt_fields, attempt_tag, recorded_error
from hpc_ddp.rundir.runlock import RunLockedError, acquire, release
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.core.codes import DIE_AT_VAR, EXIT_HUNG, HOLD_AT_VAR
from hpc_ddp.rank.watch.watchdog import poll_interval

if TYPE_CHECKING:
    from hpc_ddp.rank.loop.run import Run

log = logging.getLogger("hpc_ddp.session")
CONTROL_GROUP_VAR = "HPC_DDP_CONTROL_GROUP"  # "shared": control traffic on a gloo training group (tests only)
HOLD_S = 60.0  # the longest rank 0 waits at a step for the rehearsal's injected signal (ms when all is well;
# 10 s ran out once in CI, a launcher starved by a loaded machine, and the stop under test never happened)
DIE_WAIT_S = 5.0  # how long --fail-at waits for a victim's per-rank state to be posted before it kills it


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
    count = int(cpus) if cpus.isdigit() and int(cpus) > 0 else len(os.sched_getaffinity(0)) // env.local_world_size
    torch.set_num_threads(max(1, count))


@contextlib.contextmanager
def open_run(attempt: Attempt) -> Iterator[Run]:
    """``with open_run(attempt) as run: program(run)``; afterwards ``attempt.code`` is this rank's exit code.

    An exception from the program propagates (the worker records and reports it); the
    process group is torn down on every exit path.
    """
    from hpc_ddp.rundir import jit_files, newest, snapshot
    from hpc_ddp.rank.salvage import jit
    from hpc_ddp.rank.state.checkpointer import Checkpointer
    from hpc_ddp.rank.group.distributed import default_store, from_main, process_group
    from hpc_ddp.rank.loop.compiling import apply_cache_env
    from hpc_ddp.rank.loop.run import LoopIgnoredStop, Run
    from hpc_ddp.rank.watch.watchdog import Watchdog

    timeline.reset()
    timeline.mark("imported")  # torch and hpc_ddp's rank code are loaded (the heal timeline, core/timeline.py)
    cfg, env, environ = attempt.cfg, attempt.env, attempt.environ
    threads(environ, env)
    apply_cache_env(cfg, env, environ)  # before torch._inductor reads them (the first optimizer or DDP imports it)
    # DataLoader workers from a forkserver (our Trainer's, and a loop's that asks for one) are forked from a
    # server that has imported torch once: each epoch's new workers then start in ms, not an import each.
    # The server ignores the stop signals (its workers exit when it dies); the workers' worker_init learns the
    # run's warning signal from the environment they inherit (hpc_ddp.rank.shield.loader).
    multiprocessing.forkserver.set_forkserver_preload(["torch", FORKSERVER_PRELOAD])
    os.environ[STOP_SIGNALS_VAR] = cfg.slurm.signal
    at_exit_kill_workers()  # a script's normal exit must not wait for loader workers that ignore SIGTERM
    snapshot.FAULT_POINT = environ.get("HPC_DDP_FAULT_POINT")  # fault injection in tests only
    peer_error = functools.partial(recorded_error, attempt.run_dir, env.job_id, env.restart_count, env.in_job)
    dumps = flight.prefix(attempt.run_dir, env.job_id, env.restart_count, env.in_job)
    shared = environ.get(CONTROL_GROUP_VAR) == "shared"  # tests: the control traffic on a gloo training group
    if env.is_main and not attempt.wrapped:  # before the rendezvous: no node looks for it before it exists
        try:
            make_run_dir(attempt.run_dir, cfg.run_dir_mode)  # made here when no submit made it: closed to others
            newest.create(attempt.run_dir)
        except OSError as err:  # a full or read-only run dir fails where it matters, with its own message
            log.warning("could not create %s (%s)", newest.path(attempt.run_dir), err)
    if env.is_node_main and not attempt.wrapped and cfg.snapshot.jit and env.world_size > 1:
        jit_files.prepare(jit_files.post_for(attempt.run_dir, env))  # the node's file, before anyone reads it
    tag = attempt_tag(env.job_id, env.restart_count, env.in_job)
    moves = (functools.partial(store_moved.announced, attempt.run_dir, tag),
             functools.partial(store_moved.announce, attempt.run_dir, tag))  # rank 0 left a taken port
    with beating(attempt), process_group(env, cfg.dist, peer_error, dumps=dumps,
                                         own_control_group=False if shared else None, store_moves=moves) as device:
        import torch.distributed as dist

        from hpc_ddp.rank.group import control, nccl_report

        timeline.mark("group_ready")
        if attempt.liveness is not None:
            attempt.liveness.listen()  # every rank is past the rendezvous: rank 0 created the declaration's file
        log.info("process group: backend %s, world size %d, device %s, control traffic on %s", dist.get_backend(),
                 env.world_size, device, "its own gloo group" if control.group() is not None else "the same group")
        if env.is_main and nccl_report.FOUND is not None:  # which network NCCL chose between nodes, for the ledger
            attempt.record["nccl_net"] = dict(nccl_report.FOUND)
        if not attempt.wrapped:
            lock(attempt.run_dir, attempt.holder, env, from_main)
        try:
            watchdog = Watchdog(cfg.dist.timeout_s, env.rank, env.world_size, store=default_store(attempt.token),
                                on_hang=_on_hang(attempt, cfg.dist.timeout_s)).start()
            run: Run | None = None
            try:
                checkpointer = Checkpointer(attempt.run_dir, cfg.snapshot, env, config_hash(cfg),
                                            config=flat_values(cfg), local=attempt.local)
                on_step = _print_progress if attempt.local and env.is_main else None
                if on_step is not None and environ.get(HOLD_AT_VAR):  # the rehearsal's --preempt-at/--timeout-at
                    on_step = functools.partial(_hold_for_stop, _steps(environ[HOLD_AT_VAR]), attempt.flag)
                run = Run(cfg, env, device, checkpointer=checkpointer, stop=attempt.flag, on_step=on_step,
                          beat=watchdog.beat)
                if environ.get(DIE_AT_VAR):  # the rehearsal's --fail-at: this rank's node is lost after that step
                    run.on_step = functools.partial(_die_after, int(environ[DIE_AT_VAR]), on_step, run)
                attempt.after_failure = jit.OneHandler(functools.partial(jit.after_failure, run))
                run.on_stop = functools.partial(_line_at_stop, attempt, run)
                if attempt.liveness is not None:  # a frozen peer: the rank that finds it writes what it holds
                    attempt.liveness.before_exit = lambda message: attempt.after_failure(
                        PeerLost(message), wait_s=jit.SIDE_WAIT_S)  # then it exits, whatever the write waits for
                try:
                    yield run
                except LoopIgnoredStop as err:  # the stop snapshot is committed: end the attempt as that stop
                    log.error("%s", err)
                    _note(attempt, "the loop went on after run.boundary returned True")
                    run.step = run.checkpointer.last_step if run.checkpointer is not None else run.step
                except HpcDdpError:
                    raise  # the program's own error (explained): it fails the same way after any resume
                except Exception as err:  # a collective failed (a peer died), or the program crashed
                    attempt.after_failure(err)
                    if stop_came_first(attempt.flag, err, marker(attempt.run_dir, env)):  # a stop broke the step
                        attempt.code = end_as_stop(attempt, run, err)
                        raise StoppedMidStep(attempt.code) from err
                    raise
                if not run.stopped:
                    run.finish()  # a loop that returned without a stop has finished (idempotent)
                    _note_ignored_stop(attempt, run)
            finally:
                if run is not None:
                    run.close_metrics()
                watchdog.stop()
            if attempt.ending is None:
                _close_record(attempt, run)
            # Inside the process group, before its closing barrier: the other ranks leave only after rank 0
            # has written the ledger and requeued, so srun's --kill-on-bad-exit cannot cut that short.
            attempt.code = conclude(attempt, stopped=run.stopped, step=run.step)
            if run.stopped and not attempt.wrapped and env.world_size > 1:
                # every rank stopped here: each leaves with rank 0's code (0 for a cancel or Ctrl-C, not 3, which
                # srun and sacct would report as a failed step)
                attempt.code = control.from_main(attempt.code)
            if run.finished is not None and not run.stopped and env.is_main:
                # last, after the ledger line; under train.script the worker publishes it after its own
                target = layout.done_pending if attempt.wrapped else layout.done
                write_atomic(target(attempt.run_dir), json.dumps(run.finished))
                compile_cache.drop_if_empty(attempt.run_dir)  # the empty folder of a run that never compiled
        finally:
            if env.is_main and not attempt.wrapped:
                release(attempt.run_dir, attempt.holder)


@contextlib.contextmanager
def beating(attempt: Attempt) -> Iterator[None]:
    """This rank's liveness beats (:mod:`hpc_ddp.rank.watch.liveness`) for the attempt, from before the rendezvous (a node
    that freezes in it is found too) to after the closing barrier; the last beat says it left, on every way
    out. A wrapped script's own session does not beat: the worker that started it does."""
    from hpc_ddp.rank.watch import liveness

    attempt.liveness = None if attempt.wrapped else liveness.start(attempt.run_dir, attempt.cfg.dist, attempt.env,
                                                                  attempt.environ)
    try:
        yield
    finally:
        if attempt.liveness is not None:
            attempt.liveness.leave()


def _close_record(attempt: Attempt, run: Run) -> None:
    """The attempt's fields for its ledger line; what the loop did that makes a stop impossible or a resume
    inexact (rank/loop/advice.py) goes into its note, and into DONE.json's ``warnings``."""
    from hpc_ddp.rank.loop.advice import outside_iterate
    from hpc_ddp.rank.loop.compiling import compile_report

    attempt.record.update(end=round(time.time(), 3), first_step=run.resumed_from or 0, last_step=run.step,
                          resumed_from=run.resumed_from, **({"resume_read": run.resume_read} if run.resume_read else {}),
                          **timeline.ledger_field(attempt.environ, attempt.attempts, attempt.env.in_job),
                          **timeline.compile_field(compile_report()))
    run.advice.add(outside_iterate(run.tracked))
    run.advice.note(attempt.record)
    if run.finished is not None and run.advice.found:
        run.finished["warnings"] = list(run.advice.found)


def _line_at_stop(attempt: Attempt, run: Run, step: int) -> None:
    """``run.boundary``'s agreed stop, its snapshot committed: the ledger line now (rank/attempt/conclude.py says why)."""
    _close_record(attempt, run)
    attempt.ending = write_line(attempt, stopped=True, step=step)


def _note(attempt: Attempt, note: str) -> None:
    """A note for the ledger line; where rank 0 already wrote it, an ``amends`` line adds the note to it."""
    attempt.record["note"] = note
    if attempt.ending is not None and attempt.env.is_main and not attempt.wrapped:
        append_attempt(attempt.run_dir, {**attempt_fields(attempt.env.job_id, attempt.env.restart_count,
                                                          attempt.env.in_job), "amends": True, "note": note})


def _note_ignored_stop(attempt: Attempt, run: Run) -> None:
    """The loop returned without ever calling run.boundary: rank 0 warns once (the ledger's note and DONE.json keep
    it, :func:`_close_record`). Had a stop signal come, it could not be acted on: on a cluster the job is killed at
    the grace period's end with nothing saved, and the ledger line and the log say so."""
    if run.boundaries or attempt.wrapped:
        return
    if not attempt.flag.is_set:
        if not run.resumed_from:  # a resumed loop that has nothing left to do makes no boundary, rightly
            from hpc_ddp.rank.loop.advice import NEVER_BOUNDARY

            run.advice.add([NEVER_BOUNDARY])
        return
    name = signal.Signals(attempt.flag.signum).name if attempt.flag.signum else "a stop signal"
    attempt.record["stop_ignored"] = name
    attempt.record["note"] = f"{name} arrived and was never acted on: the loop never called run.boundary(step)"
    log.error("%s arrived and was never acted on: the loop never called run.boundary(step), so it took no "
              "snapshot and could not stop; on a cluster the job is killed at the end of the grace period and "
              "everything since the start is lost.\nHINT: call `if run.boundary(step): return` after every "
              "optimizer step", name)


def lock(run_dir: Path, me: dict[str, Any], env: DistEnv, from_main: Any) -> None:
    """Rank 0 takes the run dir's lock; every rank learns whether it could, and raises rank 0's error
    word for word: whichever rank's message reaches the user first names the job that holds the run dir."""
    problem: HpcDdpError | None = None
    if env.is_main:
        try:
            acquire(run_dir, me)
        except HpcDdpError as err:
            problem = err
    kind = "locked" if isinstance(problem, RunLockedError) else "error"
    shared = from_main(None if problem is None else f"{kind}:{problem}")
    if problem is not None:
        raise problem
    if shared is not None:
        kind, _, message = shared.partition(":")
        raise (RunLockedError if kind == "locked" else HpcDdpError)(message, key="run_dir")


def _on_hang(attempt: Attempt, timeout_s: float) -> Any:
    """Rank 0's watchdog records the hang (naming the stuck ranks) before the process ends.

    The other ranks wait a little before exiting: the stuck rank's watchdog fires first (its
    last beat is the oldest), and its exit would make rank 0's collective fail before rank 0's
    own watchdog could record the hang.
    """
    def on_hang(message: str, stuck: list[int]) -> None:
        env = attempt.env
        dumps = flight.prefix(attempt.run_dir, env.job_id, env.restart_count, env.in_job)
        dumped = flight.dump(dumps, env.rank)  # which collective this rank is in, before anyone exits
        if dumped is not None:
            log.error("the collectives this rank was in: %s", dumped)
        if attempt.after_failure is not None and env.rank not in stuck:  # it waits in a collective: it holds a step
            from hpc_ddp.rank.salvage.jit import SIDE_WAIT_S

            attempt.after_failure(PeerLost(message.splitlines()[0]), wait_s=SIDE_WAIT_S)
        if not attempt.env.is_main:
            time.sleep(min(30.0, 2 * poll_interval(timeout_s) + 2))
        if attempt.env.is_main and not attempt.wrapped:
            append_attempt(attempt.run_dir, {**attempt.record, "end": round(time.time(), 3), "reason": "hung",
                                             **timeline.ledger_field(attempt.environ, attempt.attempts, env.in_job),
                                             "stuck_ranks": stuck, "message": message.splitlines()[0],
                                             **losses.jit_fields(attempt.run_dir, env.job_id, env.restart_count,
                                                                 env.in_job),
                                             **({"collectives": str(Path(dumps).relative_to(attempt.run_dir))}
                                                if dumped is not None else {})})
        from hpc_ddp.core.shutdown import exit_fast

        if attempt.liveness is not None:
            attempt.liveness.leave()  # this exit is the hang's, not a lost rank's
        exit_fast(EXIT_HUNG)
    return on_hang


class PeerLost(RuntimeError):
    """What a just-in-time snapshot follows when this rank's liveness thread found its peer frozen, or its
    watchdog found another rank stuck."""


def _die_after(last: int, then: Any, run: Run, step: int) -> None:
    """Fault injection (``--fail-at``): SIGKILL this rank once its boundary of ``last`` has run and its per-rank
    state of that step has left for its buddy (posted by the mirror's sender thread, within a millisecond or
    so), as in a node lost during the next step."""
    if then is not None:
        then(step)
    if step >= last:
        if run.mirror is not None:
            run.mirror.wait_sent(step, DIE_WAIT_S)
        os.kill(os.getpid(), signal.SIGKILL)


def _steps(text: str) -> frozenset[int]:
    return frozenset(int(part) for part in text.split(",") if part.strip())


def _hold_for_stop(steps: frozenset[int], flag: Any, step: int) -> None:
    """The rehearsal's injected stop (``--preempt-at``/``--timeout-at``): rank 0 reports the step and waits, at
    most ``HOLD_S``, for the signal the launcher sends on reading that report. Without the wait a short run on
    a loaded machine could finish before the signal lands, and the stop under test would never happen."""
    _print_progress(step)
    deadline = time.monotonic() + HOLD_S
    while step in steps and not flag.is_set and time.monotonic() < deadline:
        time.sleep(0.01)


def _print_progress(step: int) -> None:
    """The local simulation watches rank 0 for these lines to inject signals at chosen steps."""
    from hpc_ddp.core.codes import PROGRESS_MARK

    print(f"{PROGRESS_MARK}{step}", flush=True)
