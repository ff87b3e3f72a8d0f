"""What a failure would take, kept current on a rank: opened at the resume, marked at each boundary.

The state a just-in-time snapshot of this step writes (:class:`hpc_ddp.rank.salvage.jit.Held`),
this rank's per-rank state at its buddy (:mod:`hpc_ddp.rank.salvage.mirror`), and rank 0's DDP
buffers on every rank (:mod:`hpc_ddp.rank.salvage.held`: a survivors' snapshot holds them, rank 0
lost or not). Apart from :mod:`hpc_ddp.rank.loop.run`, which calls it at the resume and at every
boundary: this is the salvage's side of the loop, not the stop protocol. It reads the run through
:class:`Holding`, so it does not import the run API back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.rank.loop.step_state import Capturing, per_rank_state
from hpc_ddp.rank.salvage import device_read, jit, jit_checks, mirror
from hpc_ddp.rank.state.checkpointer import Checkpointer
from hpc_ddp.rank.state.ddp_settle import ddp_in, sync_buffers


class Holding(Capturing, Protocol):
    """What the holding reads of the run (a :class:`hpc_ddp.rank.loop.run.Run`), and the three
    fields it sets (``held``, ``mirror``, ``broadcasts_buffers``)."""

    config: RunConfig
    env: DistEnv
    run_dir: Path
    step: int
    checkpointer: Checkpointer | None
    broadcasts_buffers: list[DistributedDataParallel]

    @property
    def rank(self) -> int: ...


def open_holding(run: Holding) -> list[DistributedDataParallel]:
    """Collective, at the resume (after the snapshot is loaded): the held state where
    ``snapshot.jit`` is on, the mirror, the DDP modules whose buffers rank 0 sends, and the resumed
    step marked. Returns the tracked DDP modules (compiled ones too), whose buckets the resume
    settles."""
    run.held = jit.Held(run.tracked) if run.config.snapshot.jit else None
    if run.held is not None and run.held.clock.device:  # its side stream made now, not on failure
        run.held.reader = device_read.CudaReader(
            lambda: run.checkpointer.pipeline if run.checkpointer is not None else None)
    ddps = [ddp for ddp in map(ddp_in, run.tracked.values()) if ddp is not None]
    run.broadcasts_buffers = [ddp for ddp in ddps if ddp.broadcast_buffers
                              and run.world_size > 1
                              and next(ddp.module.buffers(), None) is not None]
    run.mirror = mirror.open_for(run)
    if run.held is not None:
        mark(run, run.step)
        jit_checks.warn_unprotected(run)
    return ddps


def mark(run: Holding, step: int) -> None:
    """What a just-in-time snapshot of this step takes (rank/salvage/jit.py), and the per-rank
    state to the buddy; then rank 0's buffers to every rank (rank/salvage/held.py: a survivors'
    snapshot holds them, rank 0 lost or not). Only where ``run.held`` is set."""
    run.held.mark(step)
    if run.mirror is not None and run.mirror.due(step):
        run.mirror.mark(step, per_rank_state(run, cuda=True, kept=True))
    elif run.mirror is not None:  # per_rank(..., mirror=N): nothing copied at this boundary
        run.mirror.skip(step)
    if run.broadcasts_buffers and all([sync_buffers(obj) for obj in run.broadcasts_buffers]):
        run.held.synced()
