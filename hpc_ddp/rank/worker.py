"""``python -m hpc_ddp.worker --config RUN_DIR/config.yaml``: what every task of a job runs.

Started by srun (the sbatch templates), by the submitit callable, or by the
local simulation. The one place that reads ``os.environ``: it derives this
process's rank, node and rendezvous, and runs one attempt of the run's program: a Task (our
Trainer), a ``train.loop`` function, or a ``train.script`` (see :mod:`hpc_ddp.rank.attempt.session`
for opening and closing the run, :mod:`hpc_ddp.rank.script.wrapper` for scripts).
:func:`session` is the same for a script of your own: ``with hpc_ddp.session() as run:``.
Exit codes: 0 finished (or cancelled, or interrupted with Ctrl-C: snapshot
committed, not requeued), 3 stopped for a requeue, 4 hung (the watchdog ended
it), 5 another job holds the run dir, 6 the rank this one watches was lost (no
liveness beat for ``dist.liveness_s``), 2 bad config, task or environment (recorded
in the ledger as ``error`` and never requeued: it would fail the same way), 1 any
other failure (traceback in the log, prefixed by the rank) or a requeue cap reached.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.core.codes import EXIT_ERROR, EXIT_LOCKED
from hpc_ddp.core.config import RunConfig, load_config
from hpc_ddp.core.errors import HpcDdpError, first_line
from hpc_ddp.core.helptext import add_version, for_help
from hpc_ddp.core.run_dir_mode import loose_folders, run_dir_folders
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.core.stopping import EARLY_SIGNALS, StopFlag
from hpc_ddp.rank.attempt.start import node_folder, prepare, read_config
from hpc_ddp.rank.stop.broken_step import StoppedMidStep, peer_lost
from hpc_ddp.rundir import secret_env
from hpc_ddp.rundir.ledger import attempt_fields, note_error, record_error
from hpc_ddp.rundir.runlock import RunLockedError

if TYPE_CHECKING:
    from hpc_ddp.rank.loop.run import Run

log = logging.getLogger("hpc_ddp.worker")
# torch warns on import when numpy is absent (a bare torch install); keep every rank's log free of
# it
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def run(config_path: Path, environ: Mapping[str, str], flag: StopFlag | None = None) -> int:
    """One attempt of the run described by ``config_path``, as the rank ``environ`` says this is.

    Returns 0 when training finished (or had finished before), EXIT_REQUEUE when it
    stopped at a committed snapshot for a requeue, 1 when a requeue cap is reached.
    """
    folder, tag = node_folder(Path(config_path).parent, environ)
    cfg = read_config(Path(config_path), folder, tag)
    prepared = prepare(cfg, environ, flag or StopFlag(), folder, tag)
    if isinstance(prepared, int):
        return prepared
    cfg, env = prepared[0], prepared[1]
    try:
        return _attempt(*prepared)
    except HpcDdpError as err:
        _record(env, Path(cfg.run_dir), err)
        raise


def _record(env: DistEnv, run_dir: Path, err: HpcDdpError) -> None:
    """A deterministic error goes into the ledger once (a requeue would fail the same way after
    another wait in the queue); a lock refusal leaves the run, which belongs to another job,
    untouched."""
    if isinstance(err, RunLockedError):
        return
    record = {**attempt_fields(env.job_id, env.restart_count, env.in_job), "rank": env.rank,
              "end": round(time.time(), 3)}
    # a failure (the batch shell settles, heals or requeues it): no `error` line, but
    if err.retry_may_help:
        # the message, for the ranks still waiting at the rendezvous
        note_error(run_dir, record, str(err))
        return
    record_error(run_dir, record, str(err))


def _attempt(cfg: RunConfig, env: DistEnv, environ: Mapping[str, str], flag: StopFlag,
             attempts: list[dict[str, Any]], limits: dict[str, int]) -> int:
    """Open the run, hand it to the program (a Task's Trainer or a ``train.loop`` function), close
    it; or, for ``train.script``, run the script as this task's program
    (:mod:`hpc_ddp.rank.script.wrapper`)."""
    from hpc_ddp.rank.attempt.context import Attempt
    from hpc_ddp.rank.attempt.session import beating, open_run

    attempt = Attempt(cfg, env, placed(cfg, env, environ), flag, attempts, limits)
    if env.is_main:
        warn_writers(cfg)
    if cfg.train.script:
        from hpc_ddp.rank.script.wrapper import run_script

        # the script's process group is its own: this worker beats for its rank
        with beating(attempt):
            return run_script(attempt)
    program = _program(cfg)
    try:
        with open_run(attempt) as run:
            try:
                program(run)
            # a mistake of the program that torch reports as a failure
            except (RuntimeError, ValueError) as err:
                raise _explained(err) or err
    # a stop signal broke the step: recorded as that stop (rank/stop/broken_step.py)
    except StoppedMidStep as stop:
        return stop.code
    assert attempt.code is not None
    return attempt.code


def warn_writers(cfg: RunConfig) -> None:
    """Rank 0, once per attempt: a run dir, slurm/ or compile_cache/ that others may write beyond
    run_dir_mode (whoever can write it runs code as the run's owner: docs/security.md)."""
    for what, fix in loose_folders(run_dir_folders(cfg.run_dir), cfg.run_dir_mode):
        log.warning("%s\nHINT: %s", what, fix)


def _explained(err: Exception) -> HpcDdpError | None:
    """A usage error for an error torch raises that only a program's own code causes (it fails the
    same way on every retry, so it must not be retried under slurm.max_failures), or None."""
    from hpc_ddp.core.errors import UsageError, explain
    from hpc_ddp.core.mismatch import mismatch_line, mismatch_message

    mismatch = mismatch_line(str(err).splitlines())
    # torch's own check (TORCH_DISTRIBUTED_DEBUG=DETAIL): the ranks called other collectives
    if mismatch is not None:
        return UsageError(mismatch_message(mismatch))
    if "initialize the default process group twice" in str(err):
        return UsageError(explain(
            "the loop called torch.distributed.init_process_group, but hpc_ddp has already started "
            "the process "
            "group", hint="remove the init_process_group (and destroy_process_group) calls: the "
                          "run's process group "
            "is up before the loop starts, on the backend dist.backend chose (docs/own-loop.md)"))
    return None


def _program(cfg: RunConfig) -> Callable[[Any], Any]:
    """What trains: ``train.loop``'s function, or our Trainer for ``train.task``. Loaded before the
    process group starts: an import error is reported at once, on every rank, without a
    rendezvous."""
    from hpc_ddp.rank.loop.task import load_loop, load_task

    if cfg.train.loop:
        return load_loop(cfg.train.loop)
    task = load_task(cfg.train.task)

    def train_task(run: Run) -> None:
        from hpc_ddp.rank.loop.trainer import Trainer

        Trainer(task, cfg, run).train()
    return train_task


@contextlib.contextmanager
def session(config: str | Path | None = None, overrides: Sequence[str] = ()) -> Iterator[Run]:
    """``with hpc_ddp.session() as run:``: the run object for a script of your own.

    The config comes from ``config`` (a YAML file), else from the run the script belongs
    to (``train.script`` sets HPC_DDP_CONFIG), else from the defaults with the script's
    name; ``overrides`` are ``key=value`` items. Ranks and rendezvous come from Slurm or
    torchrun variables as everywhere. Inside the block: ``run.resume(...)`` and
    ``run.boundary(step)``. Leaving it after a stop ends the process with the stop's exit
    code (3: requeued; the ledger line is written and the job requeued first); after a
    finished run the script goes on. Under ``train.script`` the worker that started the
    script keeps the lock, the ledger and the requeue; standalone (``srun python train.py``)
    the session does them itself.
    """
    from hpc_ddp.rank.attempt.context import CONFIG_VAR, WRAPPED, Attempt
    from hpc_ddp.rank.attempt.session import open_run

    environ: Mapping[str, str] = os.environ
    wrapped = environ.get(WRAPPED) == "1"
    path = config or environ.get(CONFIG_VAR)
    script = Path(sys.argv[0] or "script.py")
    defaults = [] if path else [f"name={script.stem}", f"train.script={script}"]
    cfg = load_config([Path(path)] if path else [], [*defaults, *overrides])
    prepared = prepare(cfg, environ, StopFlag())
    if isinstance(prepared, int):
        raise SystemExit(prepared)

    try:
        cfg, env, environ = prepared[:3]
        attempt = Attempt(cfg, env, environ if wrapped else placed(cfg, env, environ),
                          *prepared[3:], wrapped=wrapped)
        with open_run(attempt) as run:
            yield run
    except StoppedMidStep as stop:
        raise SystemExit(stop.code) from None
    except HpcDdpError as err:
        _record(prepared[1], Path(cfg.run_dir), err)
        raise
    if attempt.code:
        raise SystemExit(attempt.code)


def placed(cfg: RunConfig, env: DistEnv, environ: Mapping[str, str]) -> Mapping[str, str]:
    """This rank's CPUs, GPUs and network checked before its first collective
    (rank/attempt/placement.py); the environment with the interface gloo and NCCL must use where the
    hostname is loopback in a multi-node job."""
    from hpc_ddp.rank.attempt.placement import check

    exports = check(cfg, env, environ)
    if not exports:
        return environ
    # gloo and NCCL read them from this process's environment; a script's child too
    os.environ.update(exports)
    return {**environ, **exports}


def main(argv: list[str] | None = None, early: StopFlag | None = None) -> int:
    """One task's attempt; its exit code. ``early``: the flag ``python -m hpc_ddp.worker`` installed
    before it imported anything (:data:`hpc_ddp.core.stopping.EARLY_SIGNALS`)."""
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.worker", description=for_help(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example:\n  srun python -m hpc_ddp.worker --config "
                                            "runs/mlp/config.yaml")
    add_version(parser)
    parser.add_argument("--config", required=True, type=Path, help="the run's resolved config.yaml")
    flag = early or StopFlag()
    flag.install(EARLY_SIGNALS)
    args = parser.parse_args(argv)
    secret_env.take(os.environ)  # the run's secret its launcher handed it, out of reach of the code
    try:
        return run(args.config, os.environ, flag)
    except RunLockedError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_LOCKED
    except HpcDdpError as err:
        print(f"error: {err}", file=sys.stderr)
        # 1: a failure, settled and capped by max_failures
        return 1 if err.retry_may_help else EXIT_ERROR
    except Exception as err:
        # where this rank waited is no news; what the survivors wrote is in the log above
        if peer_lost(err):
            log.error("a peer rank was lost, so this rank's collective failed (%s: %s)",
                      type(err).__name__,
                      first_line(err))
        else:
            log.exception("training failed")
        return 1
