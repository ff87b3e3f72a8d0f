"""The replication check sees every element of every tensor (hpc_ddp.rank.state.replication, issue 36).

It used to sample 4096 elements at a fixed stride from offset 0: a float32 tensor of 20,479 elements
was read only up to element 16,380, so a divergence confined to its last rows was never caught.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import torch

from hpc_ddp.core.config import DistConfig
from hpc_ddp.core.slurm_env import from_environ
from tests.helpers import spawn_ranks

NUMEL = 20_479  # a little above 64 KiB of float32: a fixed stride of numel // 4096 = 4 stops at 16,380
SNAPSHOTS = (100, 200, 300, 400)  # snapshot steps; caught within these or not at all


def _rank_main(environ: dict[str, str], out: "multiprocessing.Queue[Any]") -> None:
    os.environ.update(environ)
    from hpc_ddp.rank.state import replication
    from hpc_ddp.rank.group.distributed import init_process_group, teardown
    from hpc_ddp.core.errors import UsageError

    env = from_environ(environ)
    init_process_group(env, DistConfig(backend="gloo", timeout_s=30))
    torch.manual_seed(0)
    embedding = torch.randn(NUMEL)
    if env.rank == 1:
        embedding[-1000:] += 1.0  # the last rows, which one rank alone updated: an unsampled tail
    state = {"model": {"tokens.weight": embedding, "bias": torch.zeros(8)}, "step_count": 3}
    caught: tuple[int, str] | None = None
    for step in SNAPSHOTS:
        try:
            replication.check(state, step, modules={"model"})
        except UsageError as err:
            caught = (step, str(err))
            break
    teardown()
    out.put((env.rank, caught))


def test_a_divergence_confined_to_an_unsampled_tail_is_caught_at_the_first_snapshot_on_every_rank() -> None:
    results = spawn_ranks(_rank_main, 1, 2, timeout=120)
    assert [rank for rank, _ in results] == [0, 1]
    for _, caught in results:
        assert caught is not None, "the tail's divergence was never caught"
        step, message = caught
        assert step == SNAPSHOTS[0]  # every element counts at every snapshot, so the first one sees it
        assert "'model' is tracked as replicated but differs between ranks (first at tokens.weight: ranks [1]" \
            in message and "DistributedDataParallel" in message


def test_every_element_counts_at_every_snapshot_and_a_reordering_only_within_a_row_waits() -> None:
    from hpc_ddp.rank.state.replication import digests

    base = torch.randn(NUMEL)
    for index in (0, 16_381, 16_383, NUMEL - 1):  # one element anywhere, changed in its last bit: seen at once
        changed = base.clone()
        changed[index] = torch.nextafter(changed[index], torch.tensor(float("inf")))
        assert digests({"w": base}, 7) != digests({"w": changed}, 7), index
    shuffled = base.clone()
    shuffled[5000:6000] = shuffled[5000:6000].flip(0)  # the same values in another order, across rows: at once
    assert digests({"w": base}, 7) != digests({"w": shuffled}, 7)
    swapped = base.clone()
    words = swapped[: NUMEL - 1].view(torch.int64)  # two neighbouring 8-byte words swapped: the same row sums,
    words[5000], words[5001] = words[5001].clone(), words[5000].clone()  # unless a row starts between them
    seen = [step for step in range(0, 2000, 10) if digests({"w": base}, step) != digests({"w": swapped}, step)]
    assert seen and len(seen) < 20, "rows start at an offset that moves with the step: about 1 snapshot in 101"


def test_the_fused_reduction_of_a_gpu_gives_each_leaf_the_bytes_of_its_own_summary() -> None:
    """The GPU path (one index_add over every tensor of a device, one copy) and the per-leaf path agree byte for
    byte, so a digest does not depend on which ran; checked here on CPU tensors, the arithmetic is the same."""
    from hpc_ddp.rank.state.replication import fused, summary

    generator = torch.Generator().manual_seed(5)
    tensors = [torch.randn(20_479, generator=generator), torch.randn(7, generator=generator),
               torch.randint(-2**62, 2**62, (300, 70), generator=generator), torch.randn(300_000, generator=generator),  # sums that wrap around 2**64
               torch.randn(64, 64, generator=generator).to(torch.bfloat16), torch.randn(130, 33)[:, 1:],
               torch.zeros(0), torch.randn(5000, generator=generator).view(torch.uint8)[3:-1]]
    for step in (0, 10, 37):
        assert fused(tensors, step) == [bytes(summary(t, step).contiguous().numpy()) for t in tensors]
    changed = [t.clone() for t in tensors]
    changed[0][-1] += 1  # the tail of a tensor a little above 64 KiB
    assert fused(changed, 10)[0] != fused(tensors, 10)[0] and fused(changed, 10)[1:] == fused(tensors, 10)[1:]
