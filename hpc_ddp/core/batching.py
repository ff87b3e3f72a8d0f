"""The global batch, and how a world size splits it: the arithmetic of elastic resume.

One optimizer step consumes ``global_batch = batch_size x grad_accum x world_size``
samples. With ``train.global_batch_size`` set, the global batch is fixed and the
accumulation follows the world size, so a run can continue on another number of
nodes with the same batch (and, with :class:`~hpc_ddp.rank.loop.sampler.ShardSampler`'s global
position, the same data order). ``slurm.nodes`` may be a range (``2-4``): Slurm starts
the job on any count in it, so every count must split the batch. Pure: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from hpc_ddp.core.errors import ConfigError, explain

_RANGE = re.compile(r"\s*(\d+)\s*-\s*(\d+)\s*")


@dataclass(frozen=True)
class BatchPlan:
    """How one world size takes the global batch."""

    world_size: int
    batch_size: int  # samples per rank per micro-step
    grad_accum: int  # micro-steps per optimizer step
    global_batch: int  # samples per optimizer step, all ranks together

    def __str__(self) -> str:
        return (f"{self.world_size} ranks x {self.batch_size} samples x {self.grad_accum} "
                "micro-step"
                f"{'s' if self.grad_accum != 1 else ''} = global batch {self.global_batch}")


def node_counts(nodes: Any) -> range:
    """The node counts ``slurm.nodes`` allows: ``2`` -> 2 only, ``"2-4"`` -> 2, 3, 4."""
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        return range(nodes, nodes + 1)
    if isinstance(nodes, str):
        if nodes.strip().isdigit():
            return range(int(nodes), int(nodes) + 1)
        match = _RANGE.fullmatch(nodes)
        if match:
            return range(int(match.group(1)), int(match.group(2)) + 1)
    raise ValueError(f"not a node count or range: {nodes!r}")


def slurm_nodes(nodes: Any) -> str:
    """What ``--nodes=`` gets: ``"2"``, or ``"2-4"`` for a range (spaces dropped)."""
    counts = node_counts(nodes)
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def first_step_span(slurm: Any) -> tuple[int, int] | None:
    """Where submitit's first step runs in the job's node list, as (first index, count): with
    ``slurm.spare_nodes``, the most nodes ``slurm.nodes`` allows from the second (the first is the
    batch shell's, a spare); None without spares: all the job's nodes. The login node shapes that
    srun by it (:func:`hpc_ddp.login.sbatch.spare_shape`), and the batch shell reads the step's
    nodes back by it (:func:`hpc_ddp.shell.shell_rules.submitit_step_nodes`)."""
    return (1, node_counts(slurm.nodes)[-1]) if slurm.spare_nodes else None


def valid_nodes(nodes: Any) -> bool:
    """An integer >= 1, or a range MIN-MAX with 1 <= MIN <= MAX."""
    try:
        counts = node_counts(nodes)
    except ValueError:
        return False
    return len(counts) > 0 and counts.start >= 1


def plan(train: Any, world_size: int) -> BatchPlan:
    """The plan for ``world_size`` ranks; a :class:`ConfigError` listing the world sizes that fit
    when it cannot split ``train.global_batch_size``. Unset, the global batch follows the world size
    (``train.grad_accum`` kept)."""
    batch = train.batch_size
    target = getattr(train, "global_batch_size", None)
    if target is None:
        return BatchPlan(world_size, batch, train.grad_accum, batch * train.grad_accum * world_size)
    if target % (batch * world_size):
        fits = fitting_world_sizes(target, batch)
        raise ConfigError(explain(
            f"train.global_batch_size={target} cannot be split over {world_size} ranks of "
            f"train.batch_size={batch} "
            f"samples ({target} is not a multiple of {batch} x {world_size})",
            expected=f"a world size (nodes x tasks_per_node) among {', '.join(map(str, fits))}",
            hint="run on one of those world sizes, or change train.global_batch_size or "
                 "train.batch_size"),
            key="train.global_batch_size")
    return BatchPlan(world_size, batch, target // (batch * world_size), target)


def fitting_world_sizes(global_batch: int, batch_size: int) -> list[int]:
    """Every world size that splits ``global_batch`` into micro-batches of ``batch_size``."""
    if global_batch % batch_size:
        return []
    per = global_batch // batch_size
    return [w for w in range(1, per + 1) if per % w == 0]


def fitting_node_counts(train: Any, nodes: Any, tasks_per_node: int) -> tuple[list[int], list[int]]:
    """(counts in ``slurm.nodes`` whose world size splits the global batch, counts that do not)."""
    fit, unfit = [], []
    for count in node_counts(nodes):
        try:
            plan(train, count * tasks_per_node)
            fit.append(count)
        except ConfigError:
            unfit.append(count)
    return fit, unfit


def check_geometry(train: Any, nodes: Any, tasks_per_node: int) -> None:
    """Every node count Slurm may grant must split the global batch, and a range needs a fixed
    global batch for our Trainer (``train.task``; a loop or a script may size its batch its own
    way).

    Slurm (22.05) takes only ``MIN-MAX``, not a list of counts, so a range with one count that does
    not fit would fail the job after its wait in the queue: refused here, with the counts that fit.
    """
    counts = node_counts(nodes)
    if len(counts) > 1 and getattr(train, "global_batch_size",
                                   None) is None and getattr(train, "task", ""):
        batch = train.batch_size * train.grad_accum * counts.start * tasks_per_node
        raise ConfigError(explain(
            f"slurm.nodes={nodes} lets Slurm choose the node count, but train.global_batch_size is "
            "unset, so "
            "the batch per optimizer step would change with the count Slurm grants",
            expected="train.global_batch_size with a range of nodes",
            hint=f"set train.global_batch_size={batch} (the batch at {counts.start} "
            f"node{'s' if counts.start > 1 else ''}), or a single count slurm.nodes="
            f"{counts.stop - 1}"), key="train.global_batch_size")
    fit, unfit = fitting_node_counts(train, nodes, tasks_per_node)
    if not unfit:
        return
    target = train.global_batch_size
    where = f"{', '.join(map(str, unfit))} node{'s' if unfit != [1] else ''}"
    if not fit:
        sizes = fitting_world_sizes(target, train.batch_size)
        counts_fit = [w // tasks_per_node for w in sizes if w % tasks_per_node == 0]
        hint = (f"use node counts among {', '.join(map(str, counts_fit))}" if counts_fit else
                f"no node count works with slurm.tasks_per_node={tasks_per_node}; change "
                "train.batch_size or "
                "train.global_batch_size")
    else:
        hint = (f"keep to the counts that fit: {', '.join(map(str, fit))} "
                f"(e.g. slurm.nodes={_span(fit)})")
    raise ConfigError(explain(
        f"train.global_batch_size={target} cannot be split at {where} x {tasks_per_node} task"
        f"{'s' if tasks_per_node > 1 else ''} with "
        f"train.batch_size={train.batch_size}", found=f"slurm.nodes={nodes}",
        expected="node counts whose world size divides the global batch into micro-batches",
        hint=hint),
        key="slurm.nodes")


def _span(counts: list[int]) -> str:
    """The longest run of consecutive counts, as Slurm's MIN-MAX (or one count)."""
    best = (counts[0], counts[0])
    start = counts[0]
    for prev, cur in zip(counts, counts[1:] + [None]):  # type: ignore[operator]
        if cur != prev + 1:
            if prev - start > best[1] - best[0]:
                best = (start, prev)
            start = cur
    return str(best[0]) if best[0] == best[1] else f"{best[0]}-{best[1]}"


def geometry_change(before: int | None, before_config: Mapping[str, Any] | None, train: Any,
                    world_size: int) -> str:
    """For the resume warning: what a resume at another world size changes, and why it is no longer
    bit-identical ('' at the same world size). ``before_config``: the snapshot's config
    (flat_values)."""
    if before is None or before == world_size:
        return ""
    was = now = ""
    try:
        new = plan(train, world_size)
        now = f" (accumulation {new.grad_accum}, global batch {new.global_batch})"
        if before_config is not None:
            old = plan(_TrainView(before_config), before)
            was = f" (accumulation {old.grad_accum}, global batch {old.global_batch})"
    except (ConfigError, KeyError, TypeError, ValueError):
        pass
    return (f" at another world size: written by {_ranks(before)}{was}, now "
            f"{_ranks(world_size)}{now}. Same "
            "data order; every rank's RNG is reseeded from (seed, step, rank) and gradients are "
            "summed in another "
            "order, so the run is no longer bit-identical to one that never stopped (without "
            "dropout or other "
            "randomness, losses agree to float rounding; with it, they follow another random "
            "stream)")


def batch_change_problem(written: int, saved_batch: int, train: Any, world_size: int) -> str | None:
    """Why resuming a snapshot written by ``written`` ranks at global batch ``saved_batch`` on
    ``world_size`` ranks would change the batch (``train.global_batch_size`` unset), or None. The
    one check behind the login node's refusal of ``--resume`` and the Trainer's (a job from an
    sbatch template never passed the login node)."""
    if getattr(train, "global_batch_size", None) is not None or world_size == written:
        return None
    now = plan(train, world_size).global_batch
    if now == saved_batch:
        return None
    return explain(
        f"the snapshot was written by {_ranks(written)} at global batch {saved_batch}; on "
        f"{_ranks(world_size)} "
        f"the batch would be {now}, because train.global_batch_size is unset",
        expected="the same global batch when the world size changes",
        hint=f"add train.global_batch_size={saved_batch} train.grad_accum=1 (the accumulation then "
             "follows the "
        f"world size), or resume on {_ranks(written)}")


def resume_batch_problem(manifest: Mapping[str, Any], train: Any, nodes: Any,
                         tasks_per_node: int) -> str | None:
    """:func:`batch_change_problem` for the newest snapshot's ``manifest`` at every count of
    ``slurm.nodes``. Asked on the login node, so that ``--resume slurm.nodes=1`` is refused before
    anything is written or queued."""
    written, config = manifest.get("world_size"), manifest.get("config")
    try:
        counts = node_counts(nodes)
    except (ConfigError, ValueError):
        return None
    problems = (snapshot_batch_problem(written, config, train, n * tasks_per_node) for n in counts)
    return next((problem for problem in problems if problem), None)


def snapshot_batch_problem(written: Any, config: Mapping[str, Any] | None, train: Any,
                           world_size: int) -> str | None:
    """:func:`batch_change_problem` for a snapshot written by ``written`` ranks under ``config``
    (its flat_values); None when the snapshot does not record enough to tell. Asked on the login
    node and by the run on resume."""
    if not isinstance(written, int) or not config or written == world_size:
        return None
    try:
        saved = plan(_TrainView(config), written).global_batch
        return batch_change_problem(written, saved, train, world_size)
    except (ConfigError, KeyError, TypeError, ValueError):
        return None


def _ranks(count: int) -> str:
    return f"{count} rank{'s' if count != 1 else ''}"


class _TrainView:
    """The ``train.*`` keys of a snapshot's recorded config (flat_values) as attributes, for
    :func:`plan`."""

    def __init__(self, flat: Mapping[str, Any]) -> None:
        self.batch_size = int(flat["train.batch_size"])
        self.grad_accum = int(flat["train.grad_accum"])
        self.global_batch_size = flat.get("train.global_batch_size")


def replace_problem(slurm: Any) -> str:
    """Why ``slurm.straggler.action: replace`` cannot leave a slow node out ("": it can): the job
    needs a spare or a ``slurm.nodes`` range to go on with."""
    if slurm.spare_nodes > 0 or isinstance(slurm.nodes, str):
        return ""
    return ("no spare (slurm.spare_nodes=0) and a fixed slurm.nodes: nothing to go on with "
            "(slurm.spare_nodes=1, or a range such as slurm.nodes=2-4)")
