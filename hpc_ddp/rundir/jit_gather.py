"""A node's survivors gathered before their offers reach the run dir
(:mod:`hpc_ddp.rundir.jit_files`): what each rank said on its node, and who is worth waiting for
(issue 59: on evidence, never a fixed window).

A rank entering the failure path says so on its node (:func:`enter`, with its pid) before the work
that precedes its offer (the mirror's states, the held state's copy and fingerprint). A first offer
then waits only for the node's ranks that entered and have not offered yet, and are alive: a rank
still blocked in a collective (gloo frees a node's ranks one after another, as their peers exit) or
dead is not waited for, and publishes apart when it comes. The bound (:data:`GATHER_S`) only caps a
rank that entered and hangs. No torch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.core import processes
from hpc_ddp.core.atomic import write_atomic
from hpc_ddp.rundir import node_local

if TYPE_CHECKING:
    from hpc_ddp.rundir.jit_post import Post

# the most a first offer waits for a rank of its node that entered the failure path and has not
# offered (it copies and fingerprints its state meanwhile: milliseconds, a second for a large one)
GATHER_S = 2.0
GATHER_POLL_S = 0.01  # how often it looks (node-local files: no byte reaches the run dir)


def enter(post: Post) -> None:
    """This rank is at its part of the failure path: its node's first offers wait for its own."""
    node_local.ensure(post.local)
    write_atomic(post.local / f"entered-{post.local_rank}.json",
                 json.dumps({"tag": post.tag, "pid": os.getpid()}).encode())


def await_peers(post: Post, bound_s: float = GATHER_S) -> None:
    """Wait while a rank of the node entered the failure path, is alive and has not offered (up to
    ``bound_s``)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and any(_coming(post, local)
                                              for local in range(post.local_size)
                                              if local != post.local_rank):
        time.sleep(GATHER_POLL_S)


def _coming(post: Post, local: int) -> bool:
    """Local rank ``local`` entered, has not offered yet, and its process is there."""
    return local_offer(post, local) is None and _alive(post, local) is True


def _alive(post: Post, local: int) -> bool | None:
    """Whether local rank ``local``'s process (the pid it entered with) is there; None when it did
    not say it entered."""
    pid = local_json(post, post.local / f"entered-{local}.json").get("pid")
    return processes.running(pid) if isinstance(pid, int) else None


def at_work(post: Post, local: int, offer: dict[str, Any]) -> bool:
    """Local rank ``local``, whose offer is ``offer``, is still at its part: no outcome and no
    reason yet, and its process is there (one killed at its part never publishes what waits)."""
    return not {"outcome", "why"} & offer.keys() and _alive(post, local) is not False


def local_offer(post: Post, local: int) -> dict[str, Any] | None:
    """Local rank ``local``'s offer on this node: from a file of this user's that carries the
    attempt's token."""
    found = local_json(post, post.local / f"offer-{local}.json")
    offer = found.get("offer")
    return offer if isinstance(offer, dict) else None


def local_json(post: Post, path: Path) -> dict[str, Any]:
    """A JSON record of the node's folder ({} when absent, unreadable, not this user's or without
    the token)."""
    raw = node_local.read(path, 1 << 24)
    try:
        record = json.loads(raw) if raw is not None else {}
    except ValueError:
        return {}
    if not isinstance(record, dict) or record.get("tag") != post.tag:
        return {}
    record.pop("tag")
    return record
