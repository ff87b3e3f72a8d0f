"""A node's ranks must share its node-local storage (/dev/shm): where a container gives each task its own, every
rank refuses at once, after one collective, naming the rank that could not see its node's mark; real gloo ranks,
the private /dev/shm played by giving one rank a base of its own (fault injection)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from tests.helpers import spawn_ranks


def _rank(environ: dict[str, str], run_dir: str, private: int, out: "multiprocessing.Queue[tuple]") -> None:
    import os

    os.environ.update(environ)
    from hpc_ddp.core.config import DistConfig
    from hpc_ddp.core.errors import SlurmEnvError
    from hpc_ddp.core.slurm_env import from_environ
    from hpc_ddp.rank.attempt import node_shared
    from hpc_ddp.rank.group.distributed import init_process_group, teardown
    from hpc_ddp.rundir import node_local

    env = from_environ(environ)
    shm = Path(run_dir).parent / ("shm-own" if env.rank == private else "shm")
    shm.mkdir(exist_ok=True)
    node_local.SHM = shm  # the fault: this rank's /dev/shm is not its node's
    node_shared.leave_mark(Path(run_dir), env)
    init_process_group(env, DistConfig(backend="gloo", timeout_s=30))
    try:
        node_shared.agree(Path(run_dir), env)
        out.put((env.rank, ""))
    except SlurmEnvError as err:
        out.put((env.rank, str(err)))
    teardown()


def test_a_rank_with_a_private_dev_shm_makes_every_rank_refuse_naming_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    got = spawn_ranks(_rank, 2, 2, str(run_dir), 3, timeout=120)
    assert [rank for rank, _ in got] == [0, 1, 2, 3]
    assert all("rank 3 does not see the files its node's first rank left" in why and "--contain" in why
               for _, why in got), got


def test_ranks_that_share_their_nodes_dev_shm_go_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert spawn_ranks(_rank, 2, 2, str(run_dir), -1, timeout=120) == [(r, "") for r in range(4)]
