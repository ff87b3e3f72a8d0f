"""Where a survivor of a failed attempt says what it holds (:class:`Post`): the attempt's folder in
the run dir and its node's folder on node-local storage, and what the steps' tallies need to know of
the job. Apart from the files said there (:mod:`hpc_ddp.rundir.jit_files`), the claims
(:mod:`hpc_ddp.rundir.jit_claims`), the node's gathering (:mod:`hpc_ddp.rundir.jit_gather`) and the
tallies (:mod:`hpc_ddp.rundir.jit_tally`), which all take it. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.rundir.ledger import attempt_tag

JIT = "jit"


def group_size(world: int, nodes: int) -> int:
    """How many ranks one item of the per-rank tally covers: a node's worth."""
    return max(1, math.ceil(world / max(1, nodes)))


@dataclass(frozen=True)
class Post:
    """Where one survivor says what it holds: its node's folder on node-local storage (each rank's
    offer and per-rank states, :func:`hpc_ddp.rundir.beats.node_dir`) and the attempt's folder in
    the run dir, where one file per node gathers what the node's ranks said
    (:func:`hpc_ddp.rundir.jit_files.publish`)."""

    shared: Path  # RUN_DIR/jit/<attempt>
    local: Path  # this node's folder for the attempt
    rank: int
    node: int
    local_rank: int
    local_size: int
    # the attempt's tag with its token: every record in ``local`` carries it (rundir/node_local.py)
    tag: str = ""
    world: int = 0  # the attempt's ranks, and whether the set needs each one's per-rank state
    per_rank: bool = False
    group: int = 1  # ranks per item of the per-rank tally (rundir/jit_tally.py): a node's worth


def post_for(run_dir: Path | str, env: Any, per_rank: bool = False) -> Post:
    """This rank's :class:`Post` (``env``: a :class:`hpc_ddp.core.slurm_env.DistEnv`; ``per_rank``:
    the set needs every rank's per-rank state)."""
    from hpc_ddp.rundir import beats

    tag = attempt_tag(env.job_id, env.restart_count, env.in_job)
    return Post(Path(run_dir) / JIT / tag, beats.node_dir(run_dir, tag, env.node_rank) / JIT,
                env.rank,
                env.node_rank, env.local_rank, max(1, env.local_world_size),
                beats.local_tag(run_dir, tag), env.world_size, per_rank,
                group_size(env.world_size, env.num_nodes))
