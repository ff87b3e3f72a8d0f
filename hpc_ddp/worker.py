"""``python -m hpc_ddp.worker --config RUN_DIR/config.yaml``: what every task of a job runs.

Started by srun (the sbatch templates), by the submitit callable, or by the
local simulation. The one place that reads ``os.environ``: it derives this
process's DistEnv, joins the process group, resumes from the newest committed
snapshot, trains, and runs the stop protocol (signal -> flag -> agreed step ->
snapshot -> ledger -> requeue), with a hang watchdog and the run dir's lock.
Exit codes: 0 finished (or cancelled, or interrupted with Ctrl-C: snapshot
committed, not requeued), 3 stopped for a requeue, 4 hung (the watchdog ended
it), 5 another job holds the run dir, 2 bad config, task or environment (recorded
in the ledger as ``error`` and never requeued: it would fail the same way), 1 any
other failure (traceback in the log, prefixed by the rank) or a requeue cap reached.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import signal
import socket
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.config import RunConfig, flat_values, load_config, to_yaml
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.preemption import (EXIT_ERROR, EXIT_REQUEUE, REASONS_CAPPED, PreemptionError, StopFlag, append_attempt,
                                cancelled, cap_reached, job_end_time, job_spec, job_state, read_attempts,
                                record_error, recorded_error, requeue, requeue_available, signal_number, stop_reason)
from hpc_ddp.runlock import EXIT_LOCKED, RunLockedError, acquire, holder_record, release
from hpc_ddp.slurm_env import DistEnv, from_environ
from hpc_ddp.watchdog import EXIT_HUNG, Watchdog, poll_interval
from hpc_ddp.whoami import describe

log = logging.getLogger("hpc_ddp.worker")
# torch warns on import when numpy is absent (a bare torch install); keep every rank's log free of it
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def setup_logging(env: DistEnv) -> None:
    """Rank-prefixed lines; every rank logs warnings, rank 0 also progress."""
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING, force=True, stream=sys.stderr,
                        format=f"[rank {env.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def _threads(environ: Mapping[str, str], env: DistEnv) -> None:
    """Intra-op threads: OMP_NUM_THREADS if set, else SLURM_CPUS_PER_TASK, else this node's CPUs
    shared among its tasks. torch's default (all cores in every process) oversubscribes: 10x
    slower for 2 tasks on 2 cores (measured)."""
    import torch

    if "OMP_NUM_THREADS" in environ:
        return
    cpus = environ.get("SLURM_CPUS_PER_TASK", "")
    count = int(cpus) if cpus.isdigit() and int(cpus) > 0 else len(os.sched_getaffinity(0)) // env.local_world_size
    torch.set_num_threads(max(1, count))


EARLY_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)  # caught from the first line of main: a
# signal during start-up must not kill the rank before the config names the warning signal. SIGINT is
# Ctrl-C (the local launcher forwards it; srun does on a second Ctrl-C): an interruption, not a preemption.


def run(config_path: Path, environ: Mapping[str, str], flag: StopFlag | None = None) -> int:
    """One attempt of the run described by ``config_path``, as the rank ``environ`` says this is.

    Returns 0 when training finished (or had finished before), EXIT_REQUEUE when it
    stopped at a committed snapshot for a requeue, 1 when a requeue cap is reached.
    """
    cfg = load_config([config_path])
    environ = with_config_port(environ, cfg)
    env = from_environ(environ)
    flag = flag or StopFlag()
    flag.install([signal_number(cfg.slurm.signal), signal.SIGTERM, signal.SIGINT])
    setup_logging(env)
    log.info("%s", describe(env, environ.get("SLURMD_NODENAME") or socket.gethostname()))
    run_dir = Path(cfg.run_dir)
    if (run_dir / "DONE.json").exists():
        log.warning("run %s has already finished (DONE.json); nothing to do", run_dir)
        return 0
    limits = {key: getattr(cfg.slurm, key) for key in set(REASONS_CAPPED.values())}
    attempts = read_attempts(run_dir)
    capped = cap_reached("preemption", attempts, limits)
    if capped:  # Slurm requeued a preempted job once more than allowed
        log.error("%s", capped)
        return 1
    try:
        return _attempt(cfg, env, environ, flag, attempts, limits)
    except RunLockedError:
        raise  # the run belongs to another job: nothing of it is touched
    except HpcDdpError as err:
        if err.retry_may_help:
            raise
        # Deterministic: a requeue would fail the same way after another wait in the queue.
        record = {"job_id": env.job_id, "restart_count": env.restart_count, "rank": env.rank,
                  "end": round(time.time(), 3)}
        record_error(run_dir, record, str(err))
        raise


def _attempt(cfg: RunConfig, env: DistEnv, environ: Mapping[str, str], flag: StopFlag,
             attempts: list[dict[str, Any]], limits: dict[str, int]) -> int:
    from hpc_ddp import snapshot
    from hpc_ddp.checkpointer import Checkpointer
    from hpc_ddp.distributed import default_store, from_main, process_group
    from hpc_ddp.task import load_task
    from hpc_ddp.trainer import Trainer

    _threads(environ, env)
    run_dir = Path(cfg.run_dir)
    warning = signal_number(cfg.slurm.signal)
    snapshot.FAULT_POINT = environ.get("HPC_DDP_FAULT_POINT")  # fault injection in tests only
    local = environ.get("HPC_DDP_LOCAL") == "1"
    end_time = None if local or not env.is_main else job_end_time(job_spec(environ))
    task = load_task(cfg.train.task)
    started = time.time()
    me = holder_record(job_spec(environ) or str(env.job_id), local=local)
    record = {"job_id": env.job_id, "restart_count": env.restart_count, "start": round(started, 3)}
    peer_error = functools.partial(recorded_error, run_dir, env.job_id, env.restart_count)
    with process_group(env, cfg.dist, peer_error) as device:
        _lock(run_dir, me, env, from_main)
        try:
            watchdog = Watchdog(cfg.dist.timeout_s, env.rank, env.world_size, store=default_store(),
                                on_hang=_on_hang(run_dir, env, record, cfg.dist.timeout_s)).start()
            try:
                checkpointer = Checkpointer(run_dir, cfg.snapshot, env, config_hash(cfg), config=flat_values(cfg))
                on_step = _print_progress if local and env.is_main else None
                result = Trainer(task, cfg, env, device, run_dir, checkpointer=checkpointer, stop=flag,
                                 on_step=on_step, beat=watchdog.beat).train()
            finally:
                watchdog.stop()
            record.update(end=round(time.time(), 3), first_step=result["first_step"], last_step=result["step"],
                          resumed_from=result["resumed_from"])
            # Inside the process group, before its closing barrier: the other ranks leave only after rank 0
            # has written the ledger and requeued, so srun's --kill-on-bad-exit cannot cut that short.
            return _conclude(cfg, env, environ, flag, result, record, attempts, limits, warning, end_time, local)
        finally:
            if env.is_main:
                release(run_dir, me)


def _lock(run_dir: Path, me: dict[str, Any], env: DistEnv, from_main: Any) -> None:
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


def _on_hang(run_dir: Path, env: DistEnv, record: dict[str, Any], timeout_s: float) -> Any:
    """Rank 0's watchdog records the hang (naming the stuck ranks) before the process ends.

    The other ranks wait a little before exiting: the stuck rank's watchdog fires first (its
    last beat is the oldest), and its exit would make rank 0's collective fail before rank 0's
    own watchdog could record the hang.
    """
    def on_hang(message: str, stuck: list[int]) -> None:
        if not env.is_main:
            time.sleep(min(30.0, 2 * poll_interval(timeout_s) + 2))
        if env.is_main:
            append_attempt(run_dir, {**record, "end": round(time.time(), 3), "reason": "hung",
                                     "stuck_ranks": stuck, "message": message.splitlines()[0]})
        from hpc_ddp.shutdown import exit_fast

        exit_fast(EXIT_HUNG)
    return on_hang


def _conclude(cfg: RunConfig, env: DistEnv, environ: Mapping[str, str], flag: StopFlag, result: dict[str, Any],
              record: dict[str, Any], attempts: list[dict[str, Any]], limits: dict[str, int], warning: int,
              end_time: float | None, local: bool) -> int:
    """Rank 0 writes the ledger line and requeues a stopped job; returns this rank's exit code."""
    run_dir = Path(cfg.run_dir)
    if not result["stopped"]:
        if env.is_main:
            append_attempt(run_dir, {**record, "reason": "finished"})
        return 0
    if not env.is_main:
        return EXIT_REQUEUE
    if flag.signum == signal.SIGINT:
        append_attempt(run_dir, {**record, "reason": "interrupted"})
        log.info("interrupted (Ctrl-C): snapshot of step %d committed, not requeued", result["step"])
        return 0
    reason = "preemption" if flag.signum is None else stop_reason(
        flag.signum, warning, flag.received_at or time.time(), end_time, cfg.slurm.signal_delay_s)
    if not local and cancelled(flag.signum, job_state(job_spec(environ))):
        append_attempt(run_dir, {**record, "reason": "cancelled"})
        log.info("the job was cancelled (scancel): snapshot of step %d committed, not requeued; continue it "
                 "with `python -m hpc_ddp.submit ... --resume`", result["step"])
        return 0
    capped = cap_reached(reason, attempts + [{"reason": reason}], limits)
    # Who requeues: rank 0, or (where the tasks have no scontrol, e.g. a container started by srun)
    # the batch shell's settle step, which runs on the host. The ledger says which, so exactly one does.
    by = "local" if local else "workers" if requeue_available() else "batch shell"
    append_attempt(run_dir, {**record, "reason": reason, "capped": bool(capped),
                             **({} if capped else {"requeue_by": by})})
    if capped:
        log.error("%s", capped)
        return 1
    log.info("stopped at step %d for %s; snapshot committed", result["step"], reason)
    if by == "batch shell":
        log.warning("scontrol is not on PATH in the job's tasks: the batch shell's settle step requeues the job")
    elif by == "workers":
        # On preemption too: a job whose tasks exit within the grace time is not requeued by Slurm
        # (measured on 22.05 with PreemptMode=REQUEUE), so rank 0 requeues it like a time-out.
        try:
            requeue(job_spec(environ))
        except PreemptionError as err:
            log.error("%s", err)
    return EXIT_REQUEUE


def with_config_port(environ: Mapping[str, str], cfg: RunConfig) -> Mapping[str, str]:
    """``dist.master_port`` as MASTER_PORT unless the environment names one (it wins, as torchrun's does)."""
    if cfg.dist.master_port is None or "MASTER_PORT" in environ:
        return environ
    return {**environ, "MASTER_PORT": str(cfg.dist.master_port)}


def _print_progress(step: int) -> None:
    """The local simulation watches rank 0 for these lines to inject signals at chosen steps."""
    from hpc_ddp.local import PROGRESS_MARK

    print(f"{PROGRESS_MARK}{step}", flush=True)


def config_hash(cfg: RunConfig) -> str:
    """Recorded in every snapshot manifest: which config wrote it."""
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example:\n  srun python -m hpc_ddp.worker --config runs/mlp/config.yaml")
    parser.add_argument("--config", required=True, type=Path, help="the run's resolved config.yaml")
    flag = StopFlag()
    flag.install(EARLY_SIGNALS)
    args = parser.parse_args(argv)
    try:
        return run(args.config, os.environ, flag)
    except RunLockedError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_LOCKED
    except HpcDdpError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1 if err.retry_may_help else EXIT_ERROR  # 1: a failure, settled and capped by max_failures
    except Exception:
        log.exception("training failed")
        return 1


def job_main(config_path: str) -> None:
    """The callable submitit runs in every task (pickled by reference: importing it is light).

    It runs the same attempt as ``python -m hpc_ddp.worker`` and leaves with the same
    exit code. Our signal handlers, installed inside, replace submitit's, so exactly one
    requeue happens per stop (ours, from rank 0).
    """
    from hpc_ddp.shutdown import exit_fast

    exit_fast(main(["--config", config_path]))


def console_main() -> None:
    """The ``hpc-ddp-worker`` console script: like ``python -m hpc_ddp.worker``."""
    from hpc_ddp.shutdown import exit_fast  # snapshots, ledger and DONE.json are fsynced by now

    exit_fast(main())


if __name__ == "__main__":
    console_main()
