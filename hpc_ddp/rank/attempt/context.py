"""The record of one attempt on a rank: what opening it, closing it and a wrapped script need to
know.

:class:`Attempt` (the config, the environment, the stop flag, the ledger line's common fields, how
it ended), the ledger's :func:`geometry` and :func:`healed` fields, and the variables a wrapped
script's child reads. Kept apart from :mod:`hpc_ddp.rank.attempt.session` so that
:mod:`~hpc_ddp.rank.attempt.conclude` and the script wrapper name the record without importing the
session that opens the process group.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.core.batching import plan
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.core.hostlist import compress_hostlist
from hpc_ddp.core.slurm_env import HEALED_VAR, DistEnv
from hpc_ddp.core.slurm_jobs import job_end_time, job_spec
from hpc_ddp.core.stopping import StopFlag
from hpc_ddp.rundir import node_local
from hpc_ddp.rundir.ledger import attempt_fields, attempt_tag
from hpc_ddp.rundir.runlock import holder_record

if TYPE_CHECKING:
    from hpc_ddp.rank.watch.liveness import Liveness

# set by the script wrapper (hpc_ddp.rank.script.wrapper) in its child's environment
WRAPPED = "HPC_DDP_WRAPPED"
# the run's config.yaml, for hpc_ddp.session() inside a wrapped script
CONFIG_VAR = "HPC_DDP_CONFIG"


@dataclass
class Ending:
    """How the ledger line ended the attempt: this rank's exit code, and whether rank 0 still
    requeues."""

    code: int
    requeue: bool = False


@dataclass
class Attempt:
    """What the close of an attempt needs to know about it."""

    cfg: RunConfig
    env: DistEnv
    environ: Mapping[str, str]
    flag: StopFlag
    attempts: list[dict[str, Any]]
    limits: dict[str, int]
    # a script started by our worker: the worker keeps the lock, ledger and requeue
    wrapped: bool = False
    record: dict[str, Any] = field(default_factory=dict)  # the ledger line's common fields
    holder: dict[str, Any] = field(default_factory=dict)  # who this job is, for the run dir's lock
    code: int | None = None  # this rank's exit code, once the attempt is closed
    end_time: float | None = None  # the job's end (start + time limit), asked of squeue by rank 0
    liveness: Liveness | None = None  # this rank's beats (rank/watch/liveness.py), while it beats
    # the just-in-time snapshot's part of this rank (rank/salvage/jit.py's OneHandler), once the run
    # exists
    after_failure: Callable[..., object] | None = None
    # the run's (resumed_from, step) once it exists: for a line written outside the training thread
    progress: Callable[[], tuple[int | None, int]] | None = None
    ending: Ending | None = None  # once the ledger line is written (at the agreed stop)

    def __post_init__(self) -> None:
        self.record = {**attempt_fields(self.env.job_id, self.env.restart_count, self.env.in_job),
                       "start": round(time.time(), 3), **geometry(self.cfg, self.env),
                       **healed(self.environ),
                       **({"chained_from": self.env.chained_from} if self.env.chained_from else {})}
        self.holder = holder_record(job_spec(self.environ) or str(self.env.job_id),
                                    local=self.local)
        # Asked first, before the program is loaded: a task may change PATH (a container without the
        # Slurm client), and a preemption later moves the end time forward.
        if not self.local and self.env.is_main:
            self.end_time = job_end_time(job_spec(self.environ))

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def token(self) -> str:
        """The attempt's token (:func:`hpc_ddp.rundir.node_local.token`): hpc_ddp's keys in the
        store carry it."""
        return node_local.token(self.run_dir,
                                attempt_tag(self.env.job_id, self.env.restart_count,
                                            self.env.in_job))

    @property
    def local(self) -> bool:
        return self.environ.get("HPC_DDP_LOCAL") == "1"


def geometry(cfg: RunConfig, env: DistEnv) -> dict[str, Any]:
    """The attempt's shape for the ledger: nodes, world size and (when the config splits its batch)
    accumulation."""
    shape: dict[str, Any] = {"nodes": env.num_nodes, "world_size": env.world_size}
    if env.nodelist:
        shape["hosts"] = compress_hostlist(env.nodelist)
    if not cfg.train.script:
        try:
            shape["grad_accum"] = plan(cfg.train, env.world_size).grad_accum
        except HpcDdpError:
            pass  # the program raises it with the fix, and the ledger records that error
    return shape


def healed(environ: Mapping[str, str]) -> dict[str, Any]:
    """For a step the batch shell started after a failed one: what failed and what it left out, and
    why."""
    text = environ.get(HEALED_VAR)
    if not text:
        return {}
    try:
        return {"healed": json.loads(text)}
    except ValueError:
        return {}
