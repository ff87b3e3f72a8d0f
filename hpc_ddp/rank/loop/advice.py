"""What a loop does that makes its stop impossible or its resume inexact, said where the user looks.

A rank's log alone is easy to miss (on a cluster it is one of many lines in the job's ``.err``).
So each finding is logged once by rank 0 when it is found, and kept for the attempt's ledger line
(its ``note``, which ``status`` shows) and for DONE.json (``warnings``):

- the loop never called ``run.boundary(step)``: no snapshot, no stop could be acted on;
- a tracked :class:`~hpc_ddp.ShardSampler` was iterated outside ``sampler.iterate(loader)``: its
  position stays at the start of the epoch, so a resume replays the epoch;
- torch's ``DistributedSampler`` is in use (a local of the loop, or the sampler of a DataLoader
  there, or an attribute of its ``self``): it keeps no position within an epoch, and
  ``run.resume`` refuses it, so its position cannot resume. Found at the first boundary by looking
  at the loop's own variables (the frames that called ``run.boundary``, outside hpc_ddp): nothing
  of torch's is patched, and it costs one look per attempt.
- a model compiled around DDP (``torch.compile(DDP(model))``) while dynamo compiled nothing: found
  by
  :func:`hpc_ddp.rank.loop.compiling.at_first_boundary`, which says the order that compiles.
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from hpc_ddp.rank.loop.sampler import ShardSampler

log = logging.getLogger("hpc_ddp.run")

NEVER_BOUNDARY = ("the loop never called run.boundary(step): the run counts as finished at step 0, "
                  "no snapshot was "
                  "taken and no stop could be acted on; "
                  "call `if run.boundary(step): return` after every optimizer step "
                  "(docs/own-loop.md)")
OUTSIDE_ITERATE = ("the tracked ShardSampler '{name}' was iterated outside "
                   "sampler.iterate(loader): its position "
                   "stayed at the start of the epoch, so a resume replays the epoch from its start "
                   "(not exact); take "
                   "the batches with `for batch in sampler.iterate(loader):`")
DISTRIBUTED_SAMPLER = ("torch's DistributedSampler is in use ({where}): it keeps no position "
                       "within an epoch, so a "
                       "resume replays the epoch from its start (not exact); use "
                       "hpc_ddp.ShardSampler(len(data), "
                       "run.rank, run.world_size, seed=...), pass it to run.resume(sampler=...) "
                       "and take the batches "
                       "with `for batch in sampler.iterate(loader):` (docs/own-loop.md)")
FRAMES = 3  # the loop, and a helper or two it calls run.boundary from


def short_of_plan(step: int, train: Any) -> list[str]:
    """A loop that returned, unstopped, before ``train.max_steps`` (and no ``train.epochs`` to end
    it): a newcomer's loop over one epoch's ``sampler.iterate`` finished a run of 24 steps at 16,
    and nothing said so."""
    planned = train.max_steps
    if train.epochs is not None or not planned or step >= planned:
        return []
    return [f"the loop returned at step {step} of train.max_steps={planned}: the run counts as "
            f"finished at step {step}; sampler.iterate(loader) ends with its epoch, so go on to "
            "the next one until the plan: `while step < run.config.train.max_steps:` around it "
            "(docs/own-loop.md), or set train.max_steps to what the loop trains"]


def outside_iterate(tracked: dict[str, Any]) -> list[str]:
    """A finding per tracked ShardSampler that was iterated outside ``iterate()`` (it warned on its
    rank)."""
    return [OUTSIDE_ITERATE.format(name=name) for name, obj in tracked.items()
            if isinstance(obj, ShardSampler) and obj.iterated_outside]


def _distributed_sampler(value: object) -> bool:
    if isinstance(value, DistributedSampler):
        return True
    if isinstance(value, DataLoader):
        return isinstance(value.sampler, DistributedSampler) or \
            isinstance(getattr(value.batch_sampler, "sampler", None), DistributedSampler)
    return False


def distributed_samplers(frame: FrameType | None) -> list[str]:
    """Where the loop holds a DistributedSampler: ``sampler``, ``loader`` (its sampler),
    ``self.loader``."""
    found: list[str] = []
    for _ in range(FRAMES):
        if frame is None:
            break
        if not str(frame.f_globals.get("__name__", "")).startswith("hpc_ddp."):
            for name, value in frame.f_locals.items():
                if _distributed_sampler(value):
                    found.append(f"`{name}` in {frame.f_code.co_name}()")
                elif name == "self" and hasattr(value, "__dict__"):
                    found += [f"`self.{attr}` in {frame.f_code.co_name}()"
                              for attr, inner in vars(value).items()
                              if _distributed_sampler(inner)]
        frame = frame.f_back
    return [DISTRIBUTED_SAMPLER.format(where=", ".join(found))] if found else []


class Advice:
    """This attempt's findings, each logged once by rank 0 when first seen."""

    def __init__(self, is_main: bool) -> None:
        self.is_main = is_main
        self.found: list[str] = []

    def add(self, findings: list[str]) -> None:
        for text in findings:
            if text not in self.found:
                self.found.append(text)
                if self.is_main:
                    log.warning("%s", text)

    def note(self, record: dict[str, Any]) -> None:
        """The findings into a ledger record's ``note`` (after any note it has)."""
        if self.found:
            record["note"] = "; ".join([*([record["note"]] if record.get("note") else []),
                                        *self.found])
