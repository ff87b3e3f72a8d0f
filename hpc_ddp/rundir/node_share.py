"""What every rank of a node reads from the run dir as an attempt starts, read there once per node
(issue 45).

Every rank reads the run's ``config.yaml`` and the ledger before any process group exists: at 512
nodes x 8 GPUs that was 8,192 opens of two files of the shared filesystem per attempt, each one a
round trip to its server (close-to-open consistency revalidates every open). Here the first rank of
a node to ask reads the file and leaves a copy in the node's folder on node-local storage
(:func:`hpc_ddp.rundir.beats.node_dir`); the node's other ranks read the copy. Who is first is
decided by an exclusive create in that folder; a rank that finds no copy within :data:`WAIT_S` (the
first one died) reads the run dir itself. The folder is private to the user and every copy carries
the attempt's token (issue 61): another user's planted ``config.yaml`` is never read. No torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hpc_ddp.core import atomic
from hpc_ddp.rundir import node_local

WAIT_S = 30.0
POLL_S = 0.005


def read_once(source: Path, folder: Path, tag: str, wait_s: float = WAIT_S) -> bytes | None:
    """``source``'s bytes as this node's first reader found them (None: absent or unreadable there).
    ``tag``: the attempt's tag with its token (:func:`hpc_ddp.rundir.beats.local_tag`), the first
    line of every copy: a copy without it (planted, or an older attempt's) is never read; the folder
    is made private first (:func:`hpc_ddp.rundir.node_local.ensure`), so a folder another user
    planted is refused."""
    # a line naming the tag, then the bytes; ``NAME.absent`` when the run dir had none
    copy = folder / source.name
    found = _copy(copy, tag)
    if found is not None:
        return found[0]
    try:
        node_local.ensure(folder)
        os.close(os.open(folder / f"{source.name}.claim", atomic.NEW, 0o600))
    except FileExistsError:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            found = _copy(copy, tag)
            if found is not None:
                return found[0]
            time.sleep(POLL_S)
        return _read(source)
    except OSError:  # no node-local storage to share through: read it here
        return _read(source)
    data = _read(source)
    target = copy.with_name(f"{copy.name}.absent") if data is None else copy
    try:
        atomic.write_atomic(target, _head(tag) + (data or b""))
    except OSError:
        pass  # the node's other ranks wait WAIT_S, then read the run dir themselves
    return data


def copy_of(source: Path, folder: Path, tag: str) -> Path | None:
    """The node's copy of ``source`` (its first line a YAML and shell comment naming ``tag``), if
    there is one of this user's that carries the attempt's token: a config loader may read it by
    name."""
    copy = folder / source.name
    raw = node_local.read(copy, MAX_BYTES)
    return copy if raw is not None and raw.startswith(_head(tag)) else None


def _head(tag: str) -> bytes:
    return f"# hpc_ddp node copy {tag}\n".encode()


def _copy(path: Path, tag: str) -> tuple[bytes | None] | None:
    """(the shared bytes,) from the node's copy, (None,) when the run dir had none; None while there
    is none (or what is there is not this user's, or lacks the attempt's token)."""
    for name, absent in ((path, False), (path.with_name(f"{path.name}.absent"), True)):
        raw = node_local.read(name, MAX_BYTES)
        if raw is not None and raw.startswith(_head(tag)):
            return (None,) if absent else (raw[len(_head(tag)):],)
    return None


MAX_BYTES = 64 << 20  # a config or a ledger; more is no copy of ours


def _read(source: Path) -> bytes | None:
    try:
        return source.read_bytes()
    except OSError:
        return None
