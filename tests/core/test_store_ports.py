"""The rendezvous store's ports (hpc_ddp.core.store_ports, rank/group/rendezvous.py; issue 61): unguessable per
attempt, and a first port held by another program (a bare listener, another job's store) costs a move, not the
job: rank 0 serves the next candidate and the others follow it, never trusting a store without the key."""

from __future__ import annotations

import functools
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.core import store_ports
from hpc_ddp.core.config import load_config
from hpc_ddp.core.slurm_env import from_environ, simulated_environ
from hpc_ddp.rank.attempt.start import with_store_ports
from hpc_ddp.rehearsal.local import free_port
from tests.helpers import spawn_ranks


def test_each_attempt_draws_its_own_ports_that_nobody_without_the_secret_can_compute() -> None:
    one = store_ports.candidates(b"s" * 32, "job-5-restart-0")
    assert len(set(one)) == store_ports.TRIES and all(10000 <= p < 32000 for p in one)
    assert store_ports.candidates(b"s" * 32, "job-5-restart-0") == one  # every rank computes the same
    assert store_ports.candidates(b"s" * 32, "job-5-restart-0-in-job-1") != one
    assert store_ports.candidates(b"t" * 32, "job-5-restart-0") != one  # the job id alone does not give them


def test_the_worker_gives_a_slurm_task_the_attempts_ports_unless_a_port_was_chosen(tmp_path: Path) -> None:
    cfg = load_config([], ["name=ports", f"run_dir={tmp_path}", "train.task=examples.mlp:MLPTask", "train.max_steps=5"])
    task = simulated_environ(1, 2, job_id=77)[1]
    given = with_store_ports(task, cfg)
    env = from_environ(given)
    assert env.master_port == env.store_ports[0] and len(env.store_ports) == 4 and env.store_key
    assert env.master_port != from_environ(task).master_port  # not the job id's port any more
    assert env.store_key.startswith("hpc_ddp/") and with_store_ports(task, cfg) == given
    assert with_store_ports({**task, "MASTER_PORT": "29500"}, cfg)["MASTER_PORT"] == "29500"
    mine = from_environ({**given, "MASTER_PORT": "29501"})  # set after the worker's: it wins, alone
    assert mine.master_port == 29501 and mine.store_ports == () and mine.store_key is None


def _rank(environ: dict[str, str], run_dir: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from hpc_ddp.rank.group.distributed import rendezvous_store
    from hpc_ddp.rundir import store_moved

    env = from_environ(environ)
    moves = (functools.partial(store_moved.announced, run_dir, "job-1"),
             functools.partial(store_moved.announce, run_dir, "job-1"))
    store = rendezvous_store(env, timedelta(seconds=60), lambda: None, *moves)
    dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size)
    total = torch.tensor([env.rank + 1.0])
    dist.all_reduce(total)
    out.put((env.rank, float(total), store_moved.announced(run_dir, "job-1")))
    dist.destroy_process_group()


@pytest.mark.parametrize("stranger", ["listener", "another job's store"])
def test_a_first_port_held_by_a_stranger_costs_a_move_not_the_job(tmp_path: Path, monkeypatch: Any,
                                                                    stranger: str) -> None:
    ports = [free_port() for _ in range(3)]
    held: Any
    if stranger == "listener":  # accepts and never answers, as any foreign program may
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("", ports[0]))
        held.listen(8)
    else:  # a store that is not this attempt's: a rank connects, and finds no key
        import torch.distributed as dist

        held = dist.TCPStore("127.0.0.1", ports[0], 1, is_master=True, wait_for_workers=False)
    extra = {store_ports.PORTS_VAR: ",".join(map(str, ports)), store_ports.KEY_VAR: "hpc_ddp/t0ken/rendezvous"}
    # spawn_ranks keeps a test's own ports and key, the first as MASTER_PORT
    monkeypatch.setattr("hpc_ddp.core.slurm_env.simulated_environ",
                        lambda *a, **k: [{**e, **extra} for e in simulated_environ(*a, **k)])
    try:
        results = spawn_ranks(_rank, 1, 2, str(tmp_path), timeout=120)
    finally:
        held.close() if stranger == "listener" else None
    assert results == [(0, 3.0, ports[1]), (1, 3.0, ports[1])]  # both met on the next port, rank 0 said so
