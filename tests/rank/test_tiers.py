"""The control collectives in two levels (issue 45): within each node, then among the nodes' leaders by recursive
doubling. Real gloo ranks in spawned processes, at geometries with one node, a power of two of nodes and not."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.helpers import spawn_ranks


def _rank_main(environ: dict[str, str], out: Any) -> None:
    os.environ.update(environ)
    import torch

    from hpc_ddp.core.config import load_config
    from hpc_ddp.core.slurm_env import from_environ
    from hpc_ddp.rank.group import tiers
    from hpc_ddp.rank.group.distributed import init_process_group, teardown

    env = from_environ(environ)
    cfg = load_config([], ["name=t", "run_dir=/tmp/unused", "train.loop=a.b:c"])
    init_process_group(env, cfg.dist)
    two = tiers.current()
    assert two is not None
    most = two.max_of(torch.tensor([env.rank, -env.rank, 7], dtype=torch.int32)).tolist()
    flags, pending = two.start_max([int(env.rank == env.world_size - 1), 0, env.node_rank])
    pending.wait()  # on the tiers' thread, as at a boundary
    leaders = two.leaders_to_main(env.rank)
    verdict = two.from_main(f"verdict of rank {env.rank}")
    two.barrier()
    teardown()
    out.put((env.rank, most, flags.tolist(), leaders, verdict))


@pytest.mark.slow
@pytest.mark.parametrize("nodes,per_node", [(1, 3), (2, 3), (5, 1), (3, 2)])
def test_two_level_max_gather_and_broadcast_agree_with_one_level(nodes: int, per_node: int) -> None:
    results = spawn_ranks(_rank_main, nodes, per_node)
    world = nodes * per_node
    assert [r[0] for r in results] == list(range(world))
    for rank, most, flags, leaders, verdict in results:
        assert most == [world - 1, 0, 7]  # every rank's value reached every rank, whatever its node
        assert flags == [1, 0, nodes - 1]  # the last rank's stop flag, on the agreement's own thread
        assert leaders == (list(range(0, world, per_node)) if rank == 0 else None)  # one entry per node, to rank 0
        assert verdict == "verdict of rank 0"

