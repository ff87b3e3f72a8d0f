"""Whether a survivor may be a source of the survivors' snapshot (:mod:`hpc_ddp.rank.salvage.jit`),
and what the sources compare: the run's settings that rule every rank out (said at resume too), rank
0's DDP buffers, and the replicated state's fingerprint.

Apart from the failure path that offers, claims and writes (:mod:`~hpc_ddp.rank.salvage.jit`,
:mod:`~hpc_ddp.rank.salvage.jit_write`) because these are questions about the state and the run,
asked before any file is written: a resume asks one of them (:func:`warn_unprotected`) with no
failure at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp.rank.salvage.held import Held
from hpc_ddp.rank.salvage.survivor import Survivor
from hpc_ddp.rank.state.tracked import mirrored
from hpc_ddp.rank.state import replication
from hpc_ddp.rank.state.checkpointer import STEP
from hpc_ddp.rank.state.ddp_settle import ddp_in
from hpc_ddp.rundir import jit_offers, lost

log = logging.getLogger("hpc_ddp.jit")
# how long another survivor waits for rank 0's offer when DDP broadcasts rank 0's buffers
BUFFERS_SOURCE_WAIT_S = 1.0


def why_not(run: Survivor) -> str | None:
    """Why this run can write no just-in-time snapshot whatever rank is lost, or None."""
    if run.config.train.rng != "derived":
        return ("train.rng=saved: a lost rank's RNG state died with it (train.rng=derived derives "
                "it)")
    kept = mirrored(run.per_rank)
    if kept and run.mirror is None:
        return (f"per_rank objects ({', '.join(sorted(kept))}) are not mirrored (one "
                "rank): a lost rank's died with it")
    return None


def warn_unprotected(run: Survivor) -> None:
    """Rank 0, at resume: a run that can have no just-in-time snapshot and takes no periodic one
    would lose everything since its start to a failure; say so now, not after the failure."""
    reason, cfg = why_not(run), run.config.snapshot
    if reason and run.env.is_main and not cfg.every_steps and not cfg.every_minutes:
        log.warning("a failure would lose every step since the start: the survivors can write no "
                    "snapshot (%s) and snapshot.every_steps and snapshot.every_minutes are null."
                    "\nHINT: set snapshot.every_steps=N (or every_minutes), or track no per_rank "
                    "objects with train.rng=derived", reason)


def fingerprint(state: dict[str, Any], step: int, skip_buffers: dict[str, set[str]]) -> int:
    """One number for the replicated state (rank/state/replication.py's digests), without the
    buffers DDP broadcasts from rank 0 at the next forward (they differ by rank between boundaries,
    by design)."""
    kept = {name: ({k: v for k, v in value.items() if k not in skip_buffers[name]}
                   if name in skip_buffers else value)
            for name, value in state.items() if name != STEP}
    return replication.combined([(f"{name}/{path}", d)
                                 for name, items in replication.fingerprints(kept, step).items()
                                 for path, d in items])


def broadcast_buffers(run: Survivor, held: Held) -> dict[str, set[str]]:
    """The buffers DDP broadcasts from rank 0 at every forward, by tracked object (none with one
    rank)."""
    return {name: held.buffer_keys(name) for name, obj in run.tracked.items()
            if (ddp := ddp_in(obj)) is not None and ddp.broadcast_buffers
            and run.env.world_size > 1}


def why_not_buffers(rank: int, folder: Path, step: int,
                    read: Callable[[], dict[str, Any] | None] | None = None) -> str | None:
    """Why this rank, which holds its own DDP buffers of ``step`` and not rank 0's, may not write it
    (rank 0 offers no step ``step``), or None: rank 0, or a rank 0 that offers the step and writes
    it."""
    if rank == 0 or buffers_source_holds(folder, step, read=read):
        return None
    return (f"rank 0's DDP buffers (BatchNorm's running statistics) of step {step} are not on this "
            f"rank (the boundary's broadcast of them had not finished) and rank 0 offers no step "
            f"{step} (or was declared lost, and its offer is not taken): a snapshot from here "
            "would mix this rank's own statistics into the run")


def rank_zero_offer(folder: Path) -> dict[str, Any] | None:
    """Rank 0's offer, from node 0's file (read by name), or None."""
    return next((o for o in jit_offers.offers(folder, 1) if o.get("rank") == 0), None)


def buffers_source_holds(folder: Path, step: int, wait_s: float = BUFFERS_SOURCE_WAIT_S,
                         read: Callable[[], dict[str, Any] | None] | None = None) -> bool:
    """Whether rank 0 offers the same step (waiting up to ``wait_s`` for its offer). DDP broadcasts
    rank 0's buffers (BatchNorm's running statistics) at every forward, so rank 0's are the step's:
    a periodic snapshot holds them, and a survivors' snapshot written by another rank would hold
    that rank's own and the resumed run would drift from one never stopped. Rank 0 then writes it (a
    stop that broke a step leaves every rank alive). Only where the boundary's broadcast had not
    finished (rank/salvage/held.py ``buffers_synced``): when rank 0 was lost then, nobody writes
    that step, and the run falls back rather than resume from a mixture. ``read``: rank 0's offer
    (the failure path passes one read per node and tenth of a second, shared by the node's ranks:
    issue 59); by default this rank reads node 0's file, ten times a second."""
    deadline = time.monotonic() + wait_s
    read = read or (lambda: rank_zero_offer(folder))
    while True:
        found = read()
        if found is not None:  # and rank 0 not declared lost: its word is not taken (issue 60)
            return bool(found.get("source")) and found.get("step") == step and \
                0 not in lost.fence_at(folder).declared
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
