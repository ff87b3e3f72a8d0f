"""The attempt's store on one of its unguessable ports (:mod:`hpc_ddp.core.store_ports`), believed only with its key.

Rank 0 serves the first candidate it can bind and sets the key that proves the store is the attempt's (its name
carries the attempt's token); where it had to pass over a taken port it says so in the run dir
(:mod:`hpc_ddp.rundir.store_moved`). Every other rank connects to the first candidate, as before, and takes the
store only once the key is in it: a stranger's program on the port (its listener, another job's store) is never
mistaken for rank 0's. While it waits it looks, as often as for rank 0's recorded error, whether rank 0 moved.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hpc_ddp.core.errors import explain
from hpc_ddp.core.slurm_env import DistEnv

log = logging.getLogger("hpc_ddp.distributed")
POLL_S = 0.5


def port_taken(err: BaseException) -> bool:
    text = str(err)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def serve(env: DistEnv, timeout: timedelta, announce: Callable[[int], Any], error: type[Exception]) -> Any:
    """Rank 0: the store on the first candidate free on this node, with the key set."""
    for index, port in enumerate(env.store_ports):
        try:
            store = dist.TCPStore(env.master_addr, port, env.world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
        except (RuntimeError, OSError) as err:
            if not port_taken(err):
                raise
            log.warning("the rendezvous port %d on %s is held by another program: rank 0 serves the attempt's "
                        "store on its next port", port, env.master_addr)
            continue
        store.set(str(env.store_key), "1")
        if index:
            announce(port)
        return store
    raise error(explain(
        f"every rendezvous port of this attempt on {env.master_addr} (node 0) is held by another program: "
        f"{', '.join(map(str, env.store_ports))}", expected="one of them free for rank 0's store",
        hint="a new attempt draws other ports (the job is retried); to choose one yourself, set "
        "dist.master_port=PORT (docs/security.md)"))


def join(env: DistEnv, timeout: timedelta, peer_error: Callable[[], str | None],
         moved: Callable[[], int | None], error: type[Exception]) -> Any:
    """Any other rank: rank 0's store, once its key is there; rank 0's error or a move are heard meanwhile."""
    deadline = time.monotonic() + timeout.total_seconds()
    port = env.store_ports[0]
    box = _connect(env, port, timeout)
    while time.monotonic() < deadline:
        box["thread"].join(POLL_S * max(1, env.local_world_size))  # a node's ranks together look as often as one
        store = box.get("store")
        if store is not None and store.check([str(env.store_key)]):
            return store
        message = peer_error()
        if message:
            raise error(f"the job cannot start, so rank {env.rank} stops too: {message}")
        other = moved()
        if other is not None and other != port and other in env.store_ports:
            log.info("rank 0 serves the attempt's store on port %d (its first port was taken)", other)
            port, box = other, _connect(env, other, timeout)
            continue
        if "error" in box:
            raise error(explain(
                f"rank {env.rank} could not reach rank 0's rendezvous at {env.master_addr}:{port}: "
                f"{str(box['error']).splitlines()[0]}", hint="look at rank 0's log: it failed or never started"))
    raise error(explain(f"rank {env.rank} found no store of this attempt at {env.master_addr}:{port} within "
                        f"{timeout.total_seconds():g}s", hint="look at rank 0's log: it failed or never started"))


def _connect(env: DistEnv, port: int, timeout: timedelta) -> dict[str, Any]:
    """A client of the store on ``port``, made in a thread (it blocks while a foreign program holds the port)."""
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(env.master_addr, port, env.world_size, is_master=False, timeout=timeout)
        except BaseException as err:  # handed to join
            box["error"] = err

    box["thread"] = threading.Thread(target=connect, name="rendezvous", daemon=True)
    box["thread"].start()
    return box
