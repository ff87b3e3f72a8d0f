"""What a snapshot of a step holds, taken and checked: the replicated state, RNG, per-rank state.

Collective: a DDP model's buffers are made rank 0's on every rank first (DDP's next forward would
broadcast them), and the replicated state is checked alike on every rank
(:mod:`hpc_ddp.rank.state.replication`) before a periodic, stop or final snapshot writes it, or
at the first boundary, before any. Apart from :mod:`hpc_ddp.rank.loop.run`, which calls it at
those points; it reads the run through :class:`Capturing`, so it does not import the run API back.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from hpc_ddp.rank.salvage.held import Held
from hpc_ddp.rank.salvage.mirror import Mirror
from hpc_ddp.rank.state import replication
from hpc_ddp.rank.state.checkpointer import PER_RANK, STEP
from hpc_ddp.rank.state.ddp_settle import ddp_in, sync_buffers
from hpc_ddp.rank.state.rng import capture_rng
from hpc_ddp.rank.state.tracked import PerRank, RunUsageError, mirrored, pack, staged, unloadable

Taken = tuple[dict[str, Any], dict[str, Any]]  # (replicated state, this rank's RNG and per-rank)


class Capturing(Protocol):
    """What a snapshot's state is taken from (a :class:`hpc_ddp.rank.loop.run.Run`), and the one
    field it sets (``per_rank_checked``: what a resume could not load back was refused once)."""

    tracked: dict[str, Any]
    per_rank: dict[str, PerRank]
    per_rank_checked: bool
    held: Held | None
    mirror: Mirror | None

    @property
    def world_size(self) -> int: ...

    def state(self) -> dict[str, Any]: ...


def checked_state(run: Capturing, step: int, doing: str | None = None) -> Taken:
    """Collective: the replicated state (checked alike on every rank first) and this rank's RNG and
    per-rank state. A DDP model's buffers are rank 0's everywhere first: DDP's next forward would
    broadcast them."""
    synced = run.held is not None and run.held.buffers_synced  # then done where the boundary marked
    if run.world_size > 1 and not synced:
        for obj in map(ddp_in, run.tracked.values()):
            if obj is not None and obj.broadcast_buffers and not sync_buffers(obj):
                for buffer in obj.module.buffers():  # a buffer hook of the user's: one each
                    dist.broadcast(buffer, 0)  # on the training backend, as DDP's forward does
    state = run.state()
    modules = {name for name, obj in run.tracked.items() if isinstance(obj, torch.nn.Module)}
    replication.check({n: v for n, v in state.items() if n != STEP}, step, modules, doing)
    rng = capture_rng()
    if run.per_rank:  # packed once per step: the mirror's copy of this boundary where it is whole
        whole = run.mirror is not None and len(mirrored(run.per_rank)) == len(run.per_rank)
        own = run.mirror.own_bytes(step) if whole else None
        rng[PER_RANK] = own if own is not None else pack(per_rank_state(run))
    return state, rng


def per_rank_state(run: Capturing, cuda: bool = False, kept: bool = False) -> dict[str, Any]:
    """This rank's per-rank states, ready to serialize (``cuda``: CUDA tensors left on the GPU, for
    the mirror; ``kept``: only those a buddy keeps, not ``mirror="derive"``'s); the first time, what
    a resume could not load back is refused (every rank alike: a usage error, never retried)."""
    if not run.per_rank_checked:
        problem = unloadable(run.per_rank)
        if problem:
            raise RunUsageError(problem)
        run.per_rank_checked = True
    return staged(mirrored(run.per_rank) if kept else run.per_rank, cuda)
