"""The resume's first two steps on a rank: the loop's objects tracked, the newest snapshot loaded.

:meth:`hpc_ddp.rank.loop.run.Run.resume` sorts what the loop passes into replicated objects and
per-rank ones (:func:`track`), then loads the newest committed snapshot into them
(:func:`load_newest`, by :mod:`hpc_ddp.rank.state.restore`); what a failure would take is opened
after (:mod:`hpc_ddp.rank.loop.holding`). Apart from the run API, which calls it once per attempt;
it reads the run through :class:`Tracking`, so it does not import the run API back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from hpc_ddp.rank.loop.sampler import ShardSampler
from hpc_ddp.rank.metrics import timeline
from hpc_ddp.rank.state import restore
from hpc_ddp.rank.state.checkpointer import Checkpointer
from hpc_ddp.rank.state.rng import reseed
from hpc_ddp.rank.state.tracked import PerRank, check_trackable, mirrored, resize_refusal


class Tracking(restore.Resuming, Protocol):
    """What the resume reads of the run (a :class:`hpc_ddp.rank.loop.run.Run`) besides what
    :class:`hpc_ddp.rank.state.restore.Resuming` names: its checkpointer."""

    checkpointer: Checkpointer | None


def track(run: Tracking, objects: Mapping[str, object]) -> None:
    """Every object the loop passed (None skipped) tracked: a :class:`PerRank` one per rank, any
    other replicated; a :class:`ShardSampler` learns it is tracked."""
    for name, obj in objects.items():
        if obj is not None:
            check_trackable(name, obj)
            if isinstance(obj, PerRank):
                run.per_rank[name] = obj
            else:
                run.tracked[name] = obj
                if isinstance(obj, ShardSampler):
                    # its iteration outside iterate() now warns: the position would be lost
                    obj.tracked = True


def load_newest(run: Tracking) -> None:
    """Collective: the newest committed snapshot into the tracked objects, the step and the RNG
    (none: a fresh start at step 0); with ``train.rng=derived`` the next step's seeds."""
    if run.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
    # every manifest says whether this run may resume at another size
    if run.checkpointer is not None:
        run.checkpointer.refuses_resize = resize_refusal(run.per_rank, run.config.train)
        # a step without every rank's is skipped
        run.checkpointer.ranks_needed = bool(mirrored(run.per_rank))  # "derive"'s are rebuilt
    restored = run.checkpointer.restore() if run.checkpointer is not None else None
    if restored is not None:
        restore.load(run, restored)
    timeline.mark("restored")  # the heal timeline (rank/metrics/timeline.py): in memory, once
    if run.config.train.rng == "derived":
        # as every boundary does: the next step's
        reseed(run.config.train.seed, run.step, run.rank)
