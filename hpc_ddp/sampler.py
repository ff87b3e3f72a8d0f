"""Shard a dataset across ranks, reshuffle every epoch, and resume mid-epoch.

Like ``torch.utils.data.DistributedSampler`` (a seeded permutation per epoch,
padded to a multiple of the world size, rank r takes every world_size-th index
from r), plus a position: ``ShardSampler.resume(epoch, consumed)`` makes the
next iteration start after the first ``consumed`` indices of this rank's shard,
so a run stopped mid-epoch sees exactly the samples it had not seen yet.

In your own loop, track the sampler with ``run.resume(sampler=sampler)`` and take the
batches through ``sampler.iterate(loader)``: it counts what the loop has taken (not
what the loader prefetched), and seeds the loader per epoch so its workers' seeds
and the global RNG stream are the same after a resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


def epoch_order(length: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The global order of one epoch: the same on every rank."""
    if not shuffle:
        return list(range(length))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator).tolist()


def shard(order: list[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s indices, padded (by wrapping) so every rank gets the same count."""
    per_rank = -(-len(order) // world_size)
    padded = order + order[: per_rank * world_size - len(order)]
    return padded[rank::world_size]


class ShardSampler(Sampler[int]):
    """This rank's indices for the current epoch, from the resume position on."""

    def __init__(self, length: int, rank: int, world_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if length < world_size:
            raise ValueError(f"a dataset of {length} samples cannot be sharded over {world_size} ranks")
        self.length, self.rank, self.world_size = length, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.start = 0
        self.consumed = 0  # indices of this epoch's shard taken by the loop (via iterate)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (call once per epoch, as with DistributedSampler)."""
        self.epoch, self.start, self.consumed = epoch, 0, 0

    def resume(self, epoch: int, consumed: int) -> None:
        """Continue ``epoch`` after the first ``consumed`` indices of this rank's shard."""
        self.epoch, self.start, self.consumed = epoch, consumed, consumed

    @property
    def per_rank(self) -> int:
        return -(-self.length // self.world_size)

    def __iter__(self) -> Iterator[int]:
        indices = shard(epoch_order(self.length, self.epoch, self.seed, self.shuffle), self.rank, self.world_size)
        return iter(indices[self.start:])

    def __len__(self) -> int:
        return self.per_rank - self.start

    def state_dict(self) -> dict[str, int]:
        """The position: epoch and samples of this rank's shard taken (what ``run.resume`` saves)."""
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume(int(state["epoch"]), int(state["consumed"]))

    def iterate(self, loader: Any) -> Iterator[Any]:
        """The rest of this epoch's batches from ``loader`` (built on this sampler), each counted as taken.

        When the epoch runs out, the sampler moves to the next one: call it again for
        the next epoch. The loader's generator is reseeded per (seed, rank, epoch):
        without one, every new loader iterator draws its workers' base seed from the
        global torch RNG, and a resumed attempt (which starts its iterator mid-epoch)
        would shift the dropout stream.
        """
        if getattr(loader, "sampler", None) is not self:
            raise ValueError("sampler.iterate(loader) needs a DataLoader built with sampler=this sampler")
        loader.generator = torch.Generator().manual_seed(self.seed * 100003 + self.rank * 1009 + self.epoch)
        self.start = self.consumed
        size = loader.batch_size or 1
        for batch in loader:
            self.consumed = min(self.consumed + size, self.per_rank)
            yield batch
        self.set_epoch(self.epoch + 1)
