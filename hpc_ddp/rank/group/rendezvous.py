"""The job's key-value store, served by rank 0 (what ``env://`` does), on one port or on the
attempt's own.

Done here for answers ``env://`` cannot give: a port already taken on the first node is an error
that names the port, the node and the fix (``env://`` raises a bare DistNetworkError on rank 0, and
the other ranks wait out the whole timeout, or talk to whatever holds the port); and while the other
ranks wait to connect, ``peer_error()`` tells them whether rank 0 failed (it records its error in
the run dir), so every rank stops within seconds with rank 0's message.

With the attempt's unguessable ports (:mod:`hpc_ddp.core.store_ports`, the default inside a run)
rank 0 serves the first candidate it can bind and sets the key that proves the store is the
attempt's (its name carries the attempt's token); where it had to pass over a taken port it says so
in the run dir (:mod:`hpc_ddp.rundir.store_moved`). Every other rank connects to the first candidate
and takes the store only once the key is in it: a stranger's program on the port (its listener,
another job's store) is never mistaken for rank 0's. While it waits it also looks whether rank 0
moved. With one port (yours, or the job id's) a store is believed as it is, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hpc_ddp.core.errors import HpcDdpError, explain
from hpc_ddp.core.slurm_env import DistEnv

log = logging.getLogger("hpc_ddp.distributed")
# how often a node's ranks waiting for rank 0's store look for an error rank 0 recorded
PEER_POLL_S = 0.5


class DistributedError(HpcDdpError):
    """The process group cannot be set up as configured on this node."""


class RendezvousError(DistributedError):
    """Rank 0's rendezvous port is taken, or rank 0 cannot be reached: another program or job may
    hold the port now and not later, so this is a failure a new step (on a fresh port) or a requeue
    may fix, not a configuration error (exit 1, healed or requeued, never exit 2)."""

    retry_may_help = True


def port_taken(err: BaseException) -> bool:
    text = str(err)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def serve(env: DistEnv, timeout: timedelta,
          announce: Callable[[int], Any] = lambda port: None) -> Any:
    """Rank 0: the store on the first of its ports free on this node (with the attempt's key set, if
    it has one)."""
    ports = env.store_ports or (env.master_port,)
    for index, port in enumerate(ports):
        try:
            store = dist.TCPStore(env.master_addr, port, env.world_size, is_master=True,
                                  timeout=timeout,
                                  wait_for_workers=False)
        except (RuntimeError, OSError) as err:
            if not port_taken(err):
                raise
            if len(ports) == 1:
                raise _taken(env, port) from None
            log.warning("the rendezvous port %d on %s is held by another program: rank 0 serves "
                        "the attempt's "
                        "store on its next port", port, env.master_addr)
            continue
        if env.store_key:
            store.set(env.store_key, "1")
        if index:
            announce(port)
        return store
    raise RendezvousError(explain(
        f"every rendezvous port of this attempt on {env.master_addr} (node 0) is held by another "
        "program: "
        f"{', '.join(map(str, ports))}", expected="one of them free for rank 0's store",
        hint="a new attempt draws other ports (the job is retried); to choose one yourself, set "
        "dist.master_port=PORT (docs/security.md)"), key="dist.master_port")


def _taken(env: DistEnv, port: int) -> RendezvousError:
    return RendezvousError(explain(
        f"the rendezvous port {port} on {env.master_addr} (node 0, rank 0's host) is already in "
        "use by another "
        "program", expected="a free TCP port for rank 0 to serve the job's rendezvous on",
        hint="set dist.master_port=PORT to a port that is free on the job's first node (or unset "
        "MASTER_PORT if you exported it); by default the port is derived from the job id "
        "(docs/derivation.md)"), key="dist.master_port")


def join(env: DistEnv, timeout: timedelta, peer_error: Callable[[], str | None] = lambda: None,
         moved: Callable[[], int | None] = lambda: None) -> Any:
    """Any other rank: rank 0's store (once the attempt's key is in it, where it has one); rank 0's
    error, and a move to another of the attempt's ports, are heard meanwhile."""
    ports, key = env.store_ports or (env.master_port,), env.store_key
    deadline = time.monotonic() + timeout.total_seconds()
    port = ports[0]
    box = _connect(env, port, timeout)
    while True:
        # a node's ranks together look as often as one
        poll_s = PEER_POLL_S * max(1, env.local_world_size)
        if box["thread"].is_alive():
            box["thread"].join(poll_s)
        elif "store" in box:
            # connected to a store without the key (yet): wait for it, or for a move
            time.sleep(poll_s)
        store = box.get("store")
        if store is not None and (key is None or store.check([key])):
            # connected: no file to look at (at 4,096 ranks that would be 4,096 opens of the run
            # dir)
            return store
        message = peer_error()
        if message:
            # as retryable as rank 0's
            kind = RendezvousError if "rendezvous port" in message else DistributedError
            raise kind(f"the job cannot start, so rank {env.rank} stops too: {message}",
                       key="dist.master_port" if "rendezvous port" in message else None)
        other = moved() if key else None  # one port (yours, or the job id's): nowhere to move
        if other is not None and other != port and other in ports:
            log.info("rank 0 serves the attempt's store on port %d (its first port was taken)",
                     other)
            port, box = other, _connect(env, other, timeout)
            continue
        if "error" in box or (key and time.monotonic() > deadline):
            why = (f": {str(box['error']).splitlines()[0]}" if "error" in box
                   else " (no store of this attempt there)")
            raise RendezvousError(explain(
                f"rank {env.rank} could not reach rank 0's rendezvous at {env.master_addr}:{port} "
                "within "
                f"{timeout.total_seconds():g}s{why}",
                hint="look at rank 0's log: it failed or never started; if another program holds "
                     "the port "
                f"on {env.master_addr}, set dist.master_port=PORT to a free one"),
                                  key="dist.master_port")


def _connect(env: DistEnv, port: int, timeout: timedelta) -> dict[str, Any]:
    """A client of the store on ``port``, made in a thread (it blocks in recv while a foreign
    program holds the port), handed over in the returned box as ``store`` or ``error``."""
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(env.master_addr, port, env.world_size, is_master=False,
                                         timeout=timeout)
        except BaseException as err:  # handed to join
            box["error"] = err

    box["thread"] = threading.Thread(target=connect, name="rendezvous", daemon=True)
    box["thread"].start()
    return box
