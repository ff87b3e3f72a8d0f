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
- a DataLoader that shuffles with torch's ``RandomSampler`` (``shuffle=True``, no sampler
  given), found the same way: every rank draws from the whole dataset, and its position is not
  kept either (an evaluation loader, not shuffled, is left alone);
- a model compiled around DDP (``torch.compile(DDP(model))``) while dynamo compiled nothing: found
  by
  :func:`hpc_ddp.rank.loop.compiling.at_first_boundary`, which says the order that compiles.
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

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
SHUFFLED = ("a DataLoader shuffles with torch's RandomSampler ({where}: shuffle=True, "
            "no sampler): every rank draws from the whole dataset (nothing shards it between the "
            "ranks) and its position within an epoch is not kept, so a resume replays the epoch "
            "from its start (not exact); use hpc_ddp.ShardSampler(len(data), run.rank, "
            "run.world_size, seed=...) as the loader's sampler, pass it to "
            "run.resume(sampler=...) and take the batches with "
            "`for batch in sampler.iterate(loader):` (docs/own-loop.md)")
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


def _unkept(value: object) -> str | None:
    """Which sampler that keeps no position ``value`` is or draws from: "distributed" (torch's
    DistributedSampler), "shuffled" (a DataLoader's RandomSampler), else None."""
    if isinstance(value, DistributedSampler):
        return "distributed"
    if isinstance(value, DataLoader):
        inner = getattr(value.batch_sampler, "sampler", None)
        if isinstance(value.sampler, DistributedSampler) or isinstance(inner, DistributedSampler):
            return "distributed"
        if isinstance(value.sampler, RandomSampler) or isinstance(inner, RandomSampler):
            return "shuffled"
    return None


def unkept_samplers(frame: FrameType | None) -> list[str]:
    """Where the loop holds a sampler whose position cannot resume: ``sampler``, ``loader`` (its
    sampler), ``self.loader``; a finding per kind."""
    found: dict[str, list[str]] = {"distributed": [], "shuffled": []}
    seen: set[int] = set()  # one object under two names (`it = loader`) is named once

    def look(name: str, value: object) -> None:
        kind = _unkept(value)
        if kind and id(value) not in seen:
            seen.add(id(value))
            found[kind].append(name)

    for _ in range(FRAMES):
        if frame is None:
            break
        if not str(frame.f_globals.get("__name__", "")).startswith("hpc_ddp."):
            where = frame.f_code.co_name
            for name, value in frame.f_locals.items():
                look(f"`{name}` in {where}()", value)
                if name == "self" and hasattr(value, "__dict__"):
                    for attr, inner in vars(value).items():
                        look(f"`self.{attr}` in {where}()", inner)
        frame = frame.f_back
    texts = {"distributed": DISTRIBUTED_SAMPLER, "shuffled": SHUFFLED}
    return [texts[kind].format(where=", ".join(places)) for kind, places in found.items() if places]


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
