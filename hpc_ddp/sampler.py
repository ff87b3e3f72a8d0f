"""Shard a dataset across ranks, reshuffle every epoch, and resume mid-epoch.

Like ``torch.utils.data.DistributedSampler`` (a seeded permutation per epoch,
padded to a multiple of the world size, rank r takes every world_size-th index
from r), plus a position: ``ShardSampler.resume(epoch, consumed)`` makes the
next iteration start after the first ``consumed`` indices of this rank's shard,
so a run stopped mid-epoch sees exactly the samples it had not seen yet.
"""

from __future__ import annotations

from collections.abc import Iterator

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

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (call once per epoch, as with DistributedSampler)."""
        self.epoch, self.start = epoch, 0

    def resume(self, epoch: int, consumed: int) -> None:
        """Continue ``epoch`` after the first ``consumed`` indices of this rank's shard."""
        self.epoch, self.start = epoch, consumed

    @property
    def per_rank(self) -> int:
        return -(-self.length // self.world_size)

    def __iter__(self) -> Iterator[int]:
        indices = shard(epoch_order(self.length, self.epoch, self.seed, self.shuffle), self.rank, self.world_size)
        return iter(indices[self.start:])

    def __len__(self) -> int:
        return self.per_rank - self.start
