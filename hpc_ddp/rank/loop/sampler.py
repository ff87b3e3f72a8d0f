"""Shard a dataset across ranks, reshuffle every epoch, and resume mid-epoch at any world size.

The epoch's order is one seeded permutation, the same on every rank. The position in it
is global: ``sample_in_epoch``, the samples all ranks together have taken. From position
``p`` rank ``r`` of ``W`` takes ``order[p + r], order[p + r + W], ...``, so the samples of
optimizer step k are ``order[k*G : (k+1)*G]`` (G the global batch) whatever the world
size: a run stopped on 4 ranks resumes on 2 with the same batches, every sample of an
epoch used once. The epoch ends at a whole number of global batches (the remainder, fewer
than G samples, is left out, as ``drop_last`` does).

In your own loop, track the sampler with ``run.resume(sampler=sampler)`` and take the
batches through ``sampler.iterate(loader)``: it counts what the loop has taken (not
what the loader prefetched), and seeds the loader per epoch so its workers' seeds
and the global RNG stream are the same after a resume.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Sampler

from hpc_ddp.core.errors import HpcDdpError, UsageError, explain

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

log = logging.getLogger("hpc_ddp.sampler")


def epoch_order(length: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The global order of one epoch: the same on every rank."""
    if not shuffle:
        return list(range(length))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator).tolist()


class ShardSampler(Sampler[int]):
    """This rank's indices for the current epoch, from the global position on.

    ``global_batch``: the samples of one optimizer step over all ranks; the epoch is cut to a
    multiple of it (default: of the world size), so that it ends at a step boundary at any
    world size that splits the batch.
    """

    def __init__(self, length: int, rank: int, world_size: int, seed: int = 0, shuffle: bool = True,
                 global_batch: int | None = None) -> None:
        unit = global_batch or world_size
        if unit % world_size:
            raise UsageError(explain(f"ShardSampler(global_batch={unit}) cannot be split over "
                                     f"{world_size} ranks",
                                     hint="pass global_batch=run.batch.global_batch (a multiple of "
                                          "the world size)"))
        if length < unit:
            raise UsageError(f"a dataset of {length} samples cannot be sharded over {world_size} "
                             "ranks"
                             + (f" in global batches of {unit}" if global_batch else ""))
        self.length, self.rank, self.world_size = length, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.usable = length // unit * unit  # samples of an epoch that are used
        self.epoch = 0
        self.start = 0  # global position this iteration starts at
        # global position: samples of this epoch taken by all ranks (via iterate)
        self.sample_in_epoch = 0
        # run.resume(sampler=...) sets it: its position must then come from iterate()
        self.tracked = False
        self._iterating = False  # inside iterate(): the loader's own pass over the indices counts
        # a tracked sampler iterated outside iterate(): the run notes it (loop/advice.py)
        self.iterated_outside = False
        # the position a resume set, until the loop moves on
        self._restored: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, for a loop that iterates the loader itself (as with
        DistributedSampler); with :meth:`iterate` drop it: iterate moves to the next epoch itself.

        After a resume
        restored a position (``load_state_dict``/``resume``), setting the epoch it is in keeps that
        position (a tutorial's ``for epoch ...: sampler.set_epoch(epoch)`` loop stays exact), and
        setting another one is an error: it would silently train on other data than the run that was
        never stopped."""
        if self._restored is not None and (epoch, 0) != self._restored:
            if epoch == self._restored[0]:
                return  # the restored position within this epoch stands
            raise UsageError(explain(
                f"sampler.set_epoch({epoch}) after run.resume restored epoch {self._restored[0]} "
                "at sample "
                f"{self._restored[1]}: it would throw that position away, and the resumed run "
                "would differ from "
                "one that was never stopped",
                hint="start the epoch loop at the restored epoch (for epoch in "
                     "range(sampler.epoch, ...)), or drop "
                     "set_epoch: `for batch in sampler.iterate(loader)` moves to the next epoch by "
                     "itself"))
        self._restored = None
        self.epoch, self.start, self.sample_in_epoch = epoch, 0, 0

    def resume(self, epoch: int, sample_in_epoch: int) -> None:
        """Continue ``epoch`` after its first ``sample_in_epoch`` samples (all ranks together)."""
        if sample_in_epoch % self.world_size or not 0 <= sample_in_epoch <= self.usable:
            raise HpcDdpError(explain(
                f"cannot resume epoch {epoch} at sample {sample_in_epoch} on {self.world_size} "
                "ranks",
                expected=f"a multiple of the world size between 0 and {self.usable}",
                hint="resume at a world size that divides the global batch the run was written "
                     "with "
                     "(set train.global_batch_size to it)"), key="train.global_batch_size")
        self.epoch, self.start, self.sample_in_epoch = epoch, sample_in_epoch, sample_in_epoch
        self._restored = (epoch, sample_in_epoch)

    @property
    def per_rank(self) -> int:
        """Indices of a whole epoch for one rank."""
        return self.usable // self.world_size

    def __iter__(self) -> Iterator[int]:
        if self.tracked and not self._iterating and not self.iterated_outside:
            self.iterated_outside = True  # once: a loop that does this, does it every epoch
            log.warning("a tracked ShardSampler is being iterated outside sampler.iterate(loader): "
                        "its position "
                        "stays at the start of the epoch, so a resume replays the epoch from its "
                        "start. "
                        "HINT: take the batches with `for batch in sampler.iterate(loader):`")
        order = epoch_order(self.length, self.epoch, self.seed, self.shuffle)
        return iter(order[self.start + self.rank:self.usable:self.world_size])

    def __len__(self) -> int:
        return (self.usable - self.start) // self.world_size

    def state_dict(self) -> dict[str, int]:
        """The position: epoch and the global samples of it taken (what ``run.resume`` saves)."""
        return {"epoch": self.epoch, "sample_in_epoch": self.sample_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "sample_in_epoch" not in state:
            raise old_position(state)
        self.resume(int(state["epoch"]), int(state["sample_in_epoch"]))

    def iterate(self, loader: DataLoader[Any]) -> Iterator[Any]:
        """The rest of this epoch's batches from ``loader`` (built on this sampler), each counted as
        taken.

        When the epoch runs out, the sampler moves to the next one: call it again for
        the next epoch. The loader's generator is reseeded per (seed, rank, epoch):
        without one, every new loader iterator draws its workers' base seed from the
        global torch RNG, and a resumed attempt (which starts its iterator mid-epoch)
        would shift the dropout stream.
        """
        if getattr(loader, "sampler", None) is not self:
            raise UsageError(explain(
                "sampler.iterate(loader) needs a DataLoader built with sampler=this sampler",
                found=type(getattr(loader, "sampler", None)).__name__,
                hint="DataLoader(data, batch_size=..., sampler=sampler), then `for batch in "
                     "sampler.iterate(loader)`"))
        self._restored = None  # from here the loop owns the position
        loader.generator = torch.Generator().manual_seed(self.seed * 100003 + self.rank * 1009
                                                         + self.epoch)
        self.start = self.sample_in_epoch
        size = (loader.batch_size or 1) * self.world_size
        batches: Iterator[Any] | None = None
        while True:
            # only while the loader draws indices: the loop's body may do anything
            self._iterating = True
            try:
                if batches is None:
                    batches = iter(loader)  # workers prefetch (and so iterate this sampler) here
                batch = next(batches)
            except StopIteration:
                break
            finally:
                self._iterating = False
            self.sample_in_epoch = min(self.sample_in_epoch + size, self.usable)
            yield batch
        self.set_epoch(self.epoch + 1)


def old_position(state: Mapping[str, object]) -> HpcDdpError:
    """A snapshot written before positions were global (a per-rank ``consumed``): refused, with what
    to do."""
    return HpcDdpError(explain(
        f"the snapshot holds a per-rank data position ({dict(state)}), written by an hpc_ddp from "
        "before elastic "
        "resume; this version keeps one global position (sample_in_epoch) so any world size can "
        "resume",
        hint="finish the run with the hpc_ddp version that wrote it, or start a new run "
             "(run_dir=...)"),
        key="progress.consumed")
