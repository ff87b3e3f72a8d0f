"""A rank's start, before its attempt opens: where it is, which config, and whether there is work.

:func:`prepare` derives this rank's place from the environment the worker read (with the
rendezvous ports a Slurm task gets: :func:`with_config_port`, :func:`with_store_ports`), installs
the stop signals' handlers, sets up the rank-prefixed log, and reads the ledger, once per node
where a node runs several ranks (:func:`node_folder`, :func:`read_config`:
:mod:`hpc_ddp.rundir.node_share`). It answers an exit code instead when the run finished before or
a preemption cap is reached. Apart from :mod:`hpc_ddp.rank.worker`, the front door that runs the
attempt, so that ``python -m hpc_ddp.worker`` and ``hpc_ddp.session()`` share one start; it logs as
the worker (``hpc_ddp.worker``).
"""

from __future__ import annotations

import io
import logging
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.core import foreign_env, store_ports
from hpc_ddp.core.config import RunConfig, load_config
from hpc_ddp.core.errors import HpcDdpError, SlurmEnvError, explain
from hpc_ddp.core.slurm_env import DistEnv, from_environ
from hpc_ddp.core.stopping import StopFlag, signal_number
from hpc_ddp.core.whoami import describe
from hpc_ddp.rundir import beats, layout, node_local, node_share
from hpc_ddp.rundir.ledger import attempt_tag, cap_reached, caps, parse_attempts, read_attempts
from hpc_ddp.rundir.node_local import NodeLocalError

log = logging.getLogger("hpc_ddp.worker")

# the config, the rank's place, its environment, the stop flag, the ledger's attempts, the caps
Prepared = tuple[RunConfig, DistEnv, Mapping[str, str], StopFlag, list[dict[str, Any]],
                 dict[str, int]]


def whole_lines(*streams: Any) -> None:
    """Each line one write: a rank's stdout and stderr share one pipe or file, and unbuffered (as
    ``PYTHONUNBUFFERED`` makes them) a ``print`` writes its text and its newline apart, so a log
    record from another thread landed between them and two lines came out joined (``loss 2.1[rank
    0] 08:00:01 INFO ...``). Line-buffered, a line is written whole and at once; block-buffered (a
    pipe's default) it waited for kilobytes."""
    for stream in streams:
        if isinstance(stream, io.TextIOWrapper):
            try:
                stream.reconfigure(line_buffering=True, write_through=False)
            except (ValueError, OSError):  # closed or detached: leave it as it is
                pass


def setup_logging(env: DistEnv) -> None:
    """Rank-prefixed lines; every rank logs warnings, rank 0 also progress."""
    whole_lines(sys.stdout, sys.stderr)
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING, force=True,
                        stream=sys.stderr, datefmt="%H:%M:%S",
                        format=f"[rank {env.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")


def node_folder(run_dir: Path, environ: Mapping[str, str]) -> tuple[Path | None, str]:
    """Where this node's ranks share what they read from the run dir at the start
    (rundir/node_share.py), and the tag with the attempt's token that every copy there carries; no
    folder for a rank alone on its node, or a place the environment does not give yet (the error
    comes later)."""
    try:
        env = from_environ(environ)
        if env.local_world_size < 2:
            return None, ""
        tag = attempt_tag(env.job_id, env.restart_count, env.in_job)
        return beats.node_dir(run_dir, tag, env.node_rank), beats.local_tag(run_dir, tag)
    except NodeLocalError:
        raise  # a folder or a secret that is not this user's own: said now
    except Exception:  # noqa: BLE001 - prepare derives it again and says what is wrong
        return None, ""


def read_config(path: Path, folder: Path | None, tag: str) -> RunConfig:
    """The run's config, read from the run dir once per node; an error names the run dir's file."""
    if folder is not None and node_share.read_once(path, folder, tag) is not None:
        copy = node_share.copy_of(path, folder, tag)
        try:
            if copy is not None:
                return load_config([copy])
        except HpcDdpError:
            pass  # said again below, naming the file the user knows
    return load_config([path])


def prepare(cfg: RunConfig, environ: Mapping[str, str], flag: StopFlag,
            folder: Path | None = None, tag: str = "") -> Prepared | int:
    """This rank's place, signal handlers and logging; an exit code instead when there is nothing to
    do (the run finished before) or a preempted job came back once more than slurm.max_preemptions
    allows."""
    raw = environ  # what the task was given, a hook's variables included (said below)
    environ = with_store_ports(with_config_port(foreign_env.slurm_view(environ), cfg), cfg)
    env = from_environ(environ)
    flag.install([signal_number(cfg.slurm.signal), signal.SIGTERM, signal.SIGINT])
    setup_logging(env)
    set_aside = foreign_env.disagreements(raw, env)
    if set_aside:  # an enroot hook's or a wrapper's RANK, WORLD_SIZE, MASTER_ADDR
        log.warning("%s", foreign_env.warning(set_aside))
    log.info("%s", describe(env, environ.get("SLURMD_NODENAME") or socket.gethostname()))
    run_dir = Path(cfg.run_dir)
    if layout.done(run_dir).exists():
        log.warning("run %s has already finished (DONE.json); nothing to do", run_dir)
        return 0
    # after the finish check (a requeue after the finish has nothing to do whatever it finds)
    alone = foreign_env.launched_alone(env, cfg.slurm.nodes, cfg.slurm.tasks_per_node)
    if alone:
        raise SlurmEnvError(explain(alone, hint="drop that option or wrapper; with a container, "
                                              "pass the environment through (docs/cluster.md)"))
    limits = caps(cfg.slurm)
    if folder is not None:  # the ledger as this node's first rank read it
        read = node_share.read_once(layout.ledger(run_dir), folder, tag) or b""
        attempts = parse_attempts(read.decode(errors="replace"), str(layout.ledger(run_dir)))
    else:
        attempts = read_attempts(run_dir)
    capped = cap_reached("preemption", attempts, limits)
    if capped:  # Slurm requeued a preempted job once more than allowed
        log.error("%s", capped)
        return 1
    return cfg, env, environ, flag, attempts, limits


def with_config_port(environ: Mapping[str, str], cfg: RunConfig) -> Mapping[str, str]:
    """``dist.master_port`` as MASTER_PORT unless the environment names one (it wins, as
    torchrun's does)."""
    if cfg.dist.master_port is None or "MASTER_PORT" in environ:
        return environ
    return {**environ, "MASTER_PORT": str(cfg.dist.master_port)}


def with_store_ports(environ: Mapping[str, str], cfg: RunConfig) -> Mapping[str, str]:
    """A Slurm task whose port nobody chose: the attempt's unguessable ports and the key that
    proves its store (:mod:`hpc_ddp.core.store_ports`), instead of a port derived from the public
    job id."""
    if "MASTER_PORT" in environ:
        return environ  # chosen by you (or dist.master_port)
    try:
        env = from_environ(environ)
    except HpcDdpError:
        return environ  # said where the caller derives it again
    if env.source != "slurm":
        return environ  # torchrun's store, or one process outside any srun step
    tag = attempt_tag(env.job_id, env.restart_count, env.in_job)
    secret = node_local.run_secret(cfg.run_dir)
    return {**environ, **store_ports.exported(secret, tag, node_local.token(cfg.run_dir, tag))}
