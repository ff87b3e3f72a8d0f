"""The resume's side of per-rank state: each rank's saved value back into its object, or the refusal
of a resume at another world size, and how that refusal is recorded.

Apart from :mod:`hpc_ddp.rank.state.tracked` (what may be tracked, and how its state is saved): this
runs once, when an attempt resumes, and it is the one place that decides whether a refused resize
is a person's configuration error or a failure of an unattended attempt. Where a resize is refused
on an attempt nobody asked for (a requeued job that Slurm gave fewer nodes, an in-job restart
planned before the manifest said so), the refusal is a failure, not a configuration error
(:func:`resize_refused`): the requeue path goes on and gets the whole allocation back. On a
person's ``--resume`` at another size it stays an error (exit 2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.rank.state.snapshot_load import Restored
from hpc_ddp.rank.state.tracked import PerRank, RunUsageError, load_into
from hpc_ddp.core.errors import ConfigError, HpcDdpError, explain
from hpc_ddp.rundir.ledger import append_attempt, attempt_fields
from hpc_ddp.core.slurm_env import DistEnv

log = logging.getLogger("hpc_ddp.run")  # its warnings belong to the run API's resume


class ResizeRefused(HpcDdpError):
    """An attempt nobody asked for (an in-job restart, a requeue) runs at another world size than
    its snapshot's, and the run's state refuses that: a failure (exit 1), recorded as ``failed`` by
    rank 0, so the requeue path goes on (a requeued job gets its whole allocation back)."""

    retry_may_help = True


def restore_per_rank(objects: Mapping[str, PerRank], saved: Mapping[str, Any] | None,
                     restored: Restored, rank: int,
                     world_size: int, device: torch.device,
                     rebuilt: list[str] | None = None) -> str | None:
    """Put this rank's saved values back into ``objects``; the problem (refused per ``elastic``), or
    None.

    ``saved`` is None when the snapshot holds nothing for this rank: written at another world size,
    or its node's file is damaged. ``elastic="fresh"`` then keeps the value this attempt built. A
    ``mirror="derive"`` object the snapshot lacks (a survivors' snapshot never holds one) keeps the
    value the loop built at the same world size, and its name goes into ``rebuilt``.
    """
    problem = None
    for name, wanted in objects.items():
        if saved is not None and name in saved:
            load_into(wanted.obj, saved[name], device)
            continue
        if wanted.mirror == "derive" and restored.world_size in (None, world_size):
            # a survivors' snapshot never holds it: the loop rebuilt it from the data position
            if rebuilt is not None:
                rebuilt.append(name)
            continue
        why = (f"was written by {restored.world_size} ranks and this attempt has {world_size}"
               if restored.world_size not in (None, world_size) else
               "has no per-rank state named " + repr(name) if saved is not None else
               f"lost rank {rank}'s per-rank state (its node's file is damaged, or it predates "
               "per_rank)")
        if wanted.elastic == "fresh":
            log.warning("the snapshot of step %d %s: %s keeps the value this attempt built "
                        "(per_rank(..., elastic='fresh'))", restored.step, why, name)
            continue
        problem = problem or explain(
            f"cannot restore the per-rank state {name!r}: the snapshot of step {restored.step} "
            f"{why}",
            hint="resume at the world size that wrote it, or track it with "
                 f"hpc_ddp.per_rank({name}, "
            "elastic='fresh') to keep the value each rank builds in the new attempt")
    return problem


def unattended(env: DistEnv) -> str | None:
    """What started this attempt without a person: an in-job restart by the batch shell, or a
    requeue."""
    if env.in_job:
        return (f"in-job restart {env.in_job}, which the batch shell started on "
                f"{env.num_nodes} node(s)")
    if env.restart_count:
        return f"requeue {env.restart_count}, which Slurm started on {env.num_nodes} node(s)"
    if env.chained_from:
        return (f"the job that job {env.chained_from} chained (Slurm refuses requeue), started on "
                f"{env.num_nodes} node(s)")
    return None


def resize_refused(problem: str, env: DistEnv, run_dir: Path, step: int,
                   key: str | None = None) -> HpcDdpError:
    """The error for a resume at another world size that the run's state refuses (every rank raises
    it alike).

    On a person's ``--resume``: the configuration error it always was (exit 2, ``error``, never
    requeued). On an unattended attempt: :class:`ResizeRefused` (exit 1), and rank 0 writes the
    ``failed`` line that says why, before it raises: the batch shell's settle step finds it and
    takes the requeue path.
    """
    started = unattended(env)
    if started is None:
        return ConfigError(problem, key=key) if key else RunUsageError(problem)
    first = problem.splitlines()[0]
    message = (f"{first} This attempt ({started}) refused to resume at {env.world_size} ranks: "
               "recorded as failed, "
               "not as a configuration error, so the run goes on the requeue path (a requeued job "
               "gets its whole "
               "allocation back).")
    if env.is_main:
        append_attempt(run_dir, {**attempt_fields(env.job_id, env.restart_count, env.in_job),
                                 "reason": "failed",
                                 "exit_code": 1, "end": round(time.time(), 3),
                                 "nodes": env.num_nodes,
                                 "world_size": env.world_size, "snapshot": step, "last_step": step,
                                 "last_step_from": "snapshot", "resize_refused": first,
                                 "message": message})
    return ResizeRefused("\n".join([message, *problem.splitlines()[1:]]), key=key)
