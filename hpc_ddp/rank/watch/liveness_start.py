"""Whether and how this rank's liveness starts for an attempt: the window the run uses (off when
``dist.liveness_s`` is null, 0, or more than half of ``dist.timeout_s``), and where the rank sits
(its place on its node and its node's host name) from the environment.

Apart from :mod:`hpc_ddp.rank.watch.liveness` (the beating, watching thread): this is the session's
wiring, read from the config and the environment once per attempt, which the thread never needs.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.rank.watch.liveness import Liveness, Place

if TYPE_CHECKING:
    from hpc_ddp.core.config import DistConfig
    from hpc_ddp.core.slurm_env import DistEnv

log = logging.getLogger("hpc_ddp.liveness")


def effective(liveness_s: float | None, timeout_s: float) -> float | None:
    """The window this run uses; None when liveness is off: ``dist.liveness_s`` null or 0, or more
    than half of ``dist.timeout_s`` (then the hang watchdog would speak first; the config refuses
    that unless ``liveness_s`` is the default, which steps aside for a small ``dist.timeout_s``)."""
    if not liveness_s:
        return None
    return float(liveness_s) if 2 * liveness_s <= timeout_s else None


def host_of(environ: Mapping[str, str], nodelist: Sequence[str] = (), node_rank: int = 0) -> str:
    """This rank's node as Slurm names it (what the batch shell excludes), else as the hostlist
    does."""
    if environ.get("SLURMD_NODENAME"):
        return environ["SLURMD_NODENAME"]
    return nodelist[node_rank] if 0 <= node_rank < len(nodelist) else socket.gethostname()


def start(run_dir: Path, dist: DistConfig, env: DistEnv, environ: Mapping[str, str], *,
          on_lost: Callable[[str], Any], on_heard: Callable[[str], Any]) -> Liveness | None:
    """This rank's beats for the attempt, started; None when liveness is off (rank 0 says why when
    the config asked for it) or the rank is alone. The session passes how it exits
    (rank/attempt/failure.py)."""
    window = effective(dist.liveness_s, dist.timeout_s)
    # only the default can be off this way (config checks)
    if window is None and dist.liveness_s and env.is_main:
        log.info("dist.liveness_s=%g is more than half of dist.timeout_s=%s: liveness is off for "
                 "this run, and a frozen node is found by the hang watchdog after "
                 "dist.timeout_s.\nHINT: dist.liveness_s=%g turns it on", dist.liveness_s,
                 dist.timeout_s, max(1, dist.timeout_s // 4))
    if window is None or env.world_size < 2:
        return None
    place = Place(env.local_rank, max(1, env.local_world_size), env.node_rank,
                  max(1, env.num_nodes), env.master_addr or "127.0.0.1")
    return Liveness(run_dir, env.job_id, env.restart_count, env.in_job, env.rank, env.world_size,
                    host_of(environ, env.nodelist, env.node_rank), window, place=place,
                    on_lost=on_lost, on_heard=on_heard, node_watch=True).start()
