"""Resuming a run: the snapshot's state loaded into the tracked objects, per-rank state and RNG
restored, and the checks and notes that go with it (a batch that would change with the world size is
refused; a changed config is said, and a changed learning rate applied). Called by
:meth:`hpc_ddp.rank.loop.run.Run.resume`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from hpc_ddp.rank.group import control
from hpc_ddp.core.batching import geometry_change, snapshot_batch_problem
from hpc_ddp.rank.state.rng import reseed, restore_rng
from hpc_ddp.core.config import RunConfig
from hpc_ddp.core.config.diff import config_diff, describe_diff, flat_values
from hpc_ddp.core.errors import explain, first_line
from hpc_ddp.core.slurm_env import DistEnv
from hpc_ddp.rank.state.checkpointer import PER_RANK, STEP
from hpc_ddp.rank.state.snapshot_load import Restored
from hpc_ddp.rank.state.per_rank_resume import resize_refused, restore_per_rank
from hpc_ddp.rank.state.tracked import RunUsageError, load_into, unpack

log = logging.getLogger("hpc_ddp.run")


class Findings(Protocol):
    """Where a resume says what makes it inexact: logged by rank 0 and kept for the attempt's ledger
    note (a :class:`hpc_ddp.rank.loop.advice.Advice`)."""

    def add(self, findings: list[str]) -> None: ...


class Resuming(Protocol):
    """What a resume reads of the run it loads into (a :class:`hpc_ddp.rank.loop.run.Run`), and the
    four fields it sets (``step``, ``resumed_from``, ``resumed_world_size``, ``resume_read``); no
    import of the run API."""

    config: RunConfig
    env: DistEnv
    device: torch.device
    run_dir: Path
    tracked: dict[str, Any]
    per_rank: dict[str, Any]
    step: int
    resumed_from: int | None
    resumed_world_size: int | None
    resume_read: dict[str, Any] | None
    advice: Findings

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_main(self) -> bool: ...


def base_lr(group: Mapping[str, Any]) -> float:
    """A param group's base learning rate: before any scheduler's factor (``initial_lr``) when it
    has one."""
    return float(group.get("initial_lr", group["lr"]))


def load(run: Resuming, restored: Restored) -> None:
    """The snapshot's state into the tracked objects, the step and the RNG; the checks that refuse a
    resume."""
    state = restored.state
    missing = sorted(set(run.tracked) - set(state))
    if missing:
        raise RunUsageError(explain(
            f"the snapshot of step {restored.step} has no {', '.join(missing)} (it holds "
            f"{', '.join(sorted(k for k in state if k != STEP))})",
            hint="track the same names as the run that wrote it, or start a new run in another "
                 "run_dir=..."))
    built = {name: [base_lr(g) for g in obj.param_groups] for name, obj in run.tracked.items()
             if isinstance(obj, torch.optim.Optimizer)}
    refuse_batch_change(run, restored)
    for name, obj in run.tracked.items():
        load_into(obj, state[name], run.device)
    run.step = run.resumed_from = restored.step
    run.resumed_world_size, run.resume_read = restored.world_size, restored.read
    rng = dict(restored.rng) if restored.rng is not None else None
    load_per_rank(run, rng.pop(PER_RANK, None) if rng else None, restored)
    report_changes(run, restored, built)
    if rng:  # a just-in-time snapshot's entry holds the per-rank state alone (train.rng=derived)
        restore_rng(rng)  # train.rng=derived reseeds after it (Run.resume), as at every boundary
    else:
        reseed(run.config.train.seed, run.step, run.rank)

def refuse_batch_change(run: Resuming, restored: Restored) -> None:
    """A loop resumed at another world size with ``train.global_batch_size`` unset would change its
    global batch: refused, as on the login node (a job from an sbatch template never passed
    there)."""
    if not run.config.train.script:
        problem = snapshot_batch_problem(restored.world_size, restored.config, run.config.train,
                                         run.world_size)
        # a configuration error on a person's --resume; a failure on a requeue or in-job restart
        if problem:
            raise resize_refused(problem, run.env, run.run_dir, restored.step,
                                 key="train.global_batch_size")

def load_per_rank(run: Resuming, blob: bytes | None, restored: Restored) -> None:
    """Collective when per-rank state is tracked: every rank gets its own value back, or every rank
    raises the same error (a rank that has nothing to load must not leave the others in a
    collective)."""
    if not run.per_rank:
        return
    rebuilt: list[str] = []
    problem = restore_per_rank(run.per_rank, _unpacked(blob, run.rank, restored.step), restored,
                               run.rank, run.world_size, run.device, rebuilt)
    if rebuilt:  # a survivors' snapshot: exact only where the loop rebuilds them as they were
        run.advice.add([f"the snapshot of step {restored.step} holds no {', '.join(rebuilt)} "
                        "(per_rank(..., mirror='derive')): each rank keeps the value its loop "
                        "rebuilt, exact where that rebuild is (from the data position and seeds)"])
    # a survivors' snapshot with ranks' states of their last copied boundary (mirror=N)
    if restored.stale:
        run.advice.add([f"the survivors' snapshot of step {restored.step} holds the per-rank state "
                        "of " + ", ".join(f"rank {r} as of step {s}" for r, s in
                                          sorted(restored.stale.items(), key=lambda i: int(i[0])))
                        + " (per_rank(..., mirror=N) sends it every N steps): the run goes on "
                          "from it, not exactly as one never stopped"])
    first = control.to_main_and_back(problem,
                                     merge=lambda problems: next((p for p in problems if p), None))
    if first and restored.world_size not in (None, run.world_size):  # refused at another world size
        raise resize_refused(first, run.env, run.run_dir, restored.step)
    if first:
        raise RunUsageError(first)

def _unpacked(blob: bytes | None, rank: int, step: int) -> dict[str, Any] | None:
    """This rank's per-rank state from its blob; None (as for a damaged file) where the blob is
    garbage: a rank that raised here would leave its peers in the collective that follows (the issue
    61 of a garbage blob)."""
    if blob is None:
        return None
    try:
        saved = unpack(blob)
    except Exception as err:  # noqa: BLE001 - garbage raises what the unpickler meets first
        log.warning("rank %d's per-rank state in the snapshot of step %d cannot be read (%s: %s): "
                    "treated as "
                    "missing", rank, step, type(err).__name__, first_line(err, 160))
        return None
    return saved if isinstance(saved, dict) else None


def report_changes(run: Resuming, restored: Restored, built: dict[str, list[float]]) -> None:
    """Say which config keys differ from those that wrote the snapshot; apply a changed learning
    rate.

    An optimizer's state dict carries the learning rate it was built with, so loading it
    would silently undo ``--resume train.lr=...``. Where an optimizer built in this attempt
    has another base rate than the snapshot's, its param groups (and the tracked
    schedulers' bases) are rescaled to it: the schedule goes on from the snapshot's step
    at the new peak. An unchanged config builds the same rates: an exact resume is untouched.
    """
    changed = config_diff(restored.config,
                          flat_values(run.config)) if restored.config is not None else []
    changed = [c for c in changed if c[0] != "run_dir"]
    schedulers = [o for o in run.tracked.values() if isinstance(getattr(o, "base_lrs", None), list)]
    applied = ""
    for name, new_lrs in built.items():
        optimizer = run.tracked[name]
        saved = [base_lr(g) for g in optimizer.param_groups]
        for i, (group, new, old) in enumerate(zip(optimizer.param_groups, new_lrs, saved)):
            if new != old and old:
                group["lr"] *= new / old
                if "initial_lr" in group:
                    group["initial_lr"] = new
                for scheduler in schedulers:
                    if getattr(scheduler, "optimizer",
                               None) is optimizer and i < len(scheduler.base_lrs):
                        scheduler.base_lrs[i] = new
        if new_lrs != saved and not applied:
            applied = (f"; the learning rate is now based on {new_lrs[0]:g} (the snapshot's "
                       "optimizer had "
                       f"{saved[0]:g}), the schedule continuing from this step")
    geometry = geometry_change(restored.world_size, restored.config, run.config.train,
                               run.world_size)
    if (changed or geometry) and run.is_main:
        log.warning("resuming from the snapshot of step %d%s%s%s", restored.step, geometry,
                    f"{'; resumed' if geometry else ''} with a changed config: "
                    f"{describe_diff(changed)}"
                    if changed else "", applied)
