"""Sharding: every sample once per epoch across ranks, a new order each epoch, exact mid-epoch resume."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_ddp.sampler import ShardSampler


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 40), st.integers(0, 5), st.integers(0, 100))
def test_every_sample_exactly_once_per_epoch(world: int, per_rank: int, epoch: int, seed: int) -> None:
    length = world * per_rank
    seen = []
    for rank in range(world):
        sampler = ShardSampler(length, rank, world, seed=seed)
        sampler.set_epoch(epoch)
        seen += list(sampler)
    assert sorted(seen) == list(range(length))


def test_uneven_lengths_pad_so_every_rank_has_the_same_count() -> None:
    counts = [len(list(ShardSampler(10, rank, 4))) for rank in range(4)]
    assert counts == [3, 3, 3, 3]


def test_a_new_epoch_reshuffles_and_the_same_epoch_repeats() -> None:
    sampler = ShardSampler(64, 0, 2, seed=3)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    sampler.set_epoch(0)
    assert second != first and list(sampler) == first


@given(st.integers(0, 32), st.integers(0, 3))
def test_resume_continues_with_exactly_the_unseen_samples(consumed: int, epoch: int) -> None:
    sampler = ShardSampler(64, 1, 2, seed=9)
    sampler.set_epoch(epoch)
    whole = list(sampler)
    sampler.resume(epoch, consumed)
    assert list(sampler) == whole[consumed:] and len(sampler) == 32 - consumed


def test_too_few_samples_for_the_ranks() -> None:
    with pytest.raises(ValueError, match="cannot be sharded"):
        ShardSampler(3, 0, 4)
