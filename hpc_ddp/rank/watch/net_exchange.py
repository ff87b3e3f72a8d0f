"""Where each node's watcher answers pings, handed to the node before it through the process group's
store once the group is formed (issue 60), not only through the run dir.

The watcher of the node before learns where to ping from the watched node's beat in the run dir,
read once a period (5 s at the default window) through its own node's view of the file server,
which keeps a name it looked up while the name was absent (NFS: ``acdirmax``, 60 s by default; 30 s
on the local cluster of machines). So a node cut off in its attempt's first half minute was never
pinged and never declared: B16 found a partition 9 s into an attempt unseen, and slurmctld's node
timeout killed the whole step 60 s later, survivors and their snapshot with it.

The store at ``MASTER_ADDR`` answers at once. Each node's first rank, when the group is formed, puts
there its watcher's endpoint, its node's ranks and host (under the attempt's token: a client that
does not know it cannot set a key), waits for the next node's (a poll with a bound, from a thread:
the store's client serves one call at a time, and the watchdog's beats use it too) and hands it to
its watcher through the node's folder (:data:`PEER`). The watcher pings from then on; a run-dir beat
that names an endpoint takes over (a node that left, the node past it). Three store calls a node,
once an attempt. No torch.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp.rank.watch import declaration
from hpc_ddp.rank.watch.next_node import PEER
from hpc_ddp.rank.watch.watcher_marker import marker
from hpc_ddp.rundir import beats
from hpc_ddp.rundir.beats import Beat

log = logging.getLogger("hpc_ddp.liveness")
WAIT_S = 30.0  # for the next node's first rank to reach the same point (past the rendezvous)
MARKER_S = 5.0  # for this node's watcher to say where it answers
POLL_S = 0.2


def key(tag: str, node: int) -> str:
    return f"net/{tag}/{node}"


def hand_over(store: Any, folder: Path, local_tag: str, tag: str, node: int, nodes: int,
              own: dict[str, Any], clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> Beat | None:
    """Publish this node's ``own`` (``first`` rank, ``ranks``, ``host``) with its watcher's
    endpoint, and write the next node's into ``folder / PEER``; the next node as handed, or None
    (alone, or it never came within :data:`WAIT_S`)."""
    if nodes < 2:
        return None
    began = clock()
    deadline = began + MARKER_S
    watcher = beats.read(marker(folder), local_tag, own=True)
    while (watcher is None or watcher.net is None) and clock() < deadline:
        sleep(POLL_S)
        watcher = beats.read(marker(folder), local_tag, own=True)
    store.set(key(tag, node), json.dumps({**own, "net": None if watcher is None else watcher.net}))
    peer = (node + 1) % nodes
    deadline = clock() + WAIT_S
    while not store.check([key(tag, peer)]):
        if clock() > deadline:
            log.info("node %d: node %d's watcher endpoint did not come through the store in %gs: "
                     "its beat in the run dir will say it", node, peer, WAIT_S)
            return None
        sleep(POLL_S)
    said = json.loads(store.get(key(tag, peer)))
    handed = Beat(local_tag, int(said["first"]), str(said["host"]), 0, node=peer,
                  ranks=tuple(int(r) for r in said["ranks"]), net=said.get("net"))
    declaration.rewrite(folder / PEER, beats.encode(handed))
    log.info("node %d: node %d's watcher answers at %s (handed over through the store in %.1fs)",
             node, peer, handed.net, clock() - began)
    return handed


def start(store: Any, liveness: Any) -> threading.Thread | None:
    """The hand-over of a node's first rank whose watcher runs, from a thread; None elsewhere."""
    if store is None or liveness is None or not liveness.leader or liveness.watcher.process is None:
        return None
    place = liveness.place
    own = {"first": liveness.rank, "ranks": sorted(liveness.on_node), "host": liveness.host}

    def run() -> None:
        try:
            hand_over(store, liveness.folder, liveness.local_tag, liveness.tag, place.node,
                      place.nodes, own)
        except Exception as err:  # noqa: BLE001 (the run dir's beat still says it, later)
            log.info("node %d: the watchers' endpoints were not handed over: %s", place.node, err)

    thread = threading.Thread(target=run, name="hpc_ddp-net-exchange", daemon=True)
    thread.start()
    return thread
