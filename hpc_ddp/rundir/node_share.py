"""What every rank of a node reads from the run dir as an attempt starts, read there once per node (issue 45).

Every rank reads the run's ``config.yaml`` and the ledger before any process group exists: at 512 nodes x 8
GPUs that was 8,192 opens of two files of the shared filesystem per attempt, each one a round trip to its
server (close-to-open consistency revalidates every open). Here the first rank of a node to ask reads the file
and leaves a copy in the node's folder on node-local storage (:func:`hpc_ddp.rundir.beats.node_dir`); the
node's other ranks read the copy. Who is first is decided by an exclusive create in that folder; a rank that
finds no copy within :data:`WAIT_S` (the first one died) reads the run dir itself. No torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

WAIT_S = 30.0
POLL_S = 0.005


def read_once(source: Path, folder: Path, wait_s: float = WAIT_S) -> bytes | None:
    """``source``'s bytes as this node's first reader found them (None: absent or unreadable there)."""
    copy = folder / source.name  # verbatim; ``NAME.absent`` instead when the run dir had none
    found = _copy(copy)
    if found is not None:
        return found[0]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.close(os.open(folder / f"{source.name}.claim", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            found = _copy(copy)
            if found is not None:
                return found[0]
            time.sleep(POLL_S)
        return _read(source)
    except OSError:  # no node-local storage to share through: read it here
        return _read(source)
    data = _read(source)
    temporary = folder / f".{source.name}.{os.getpid()}"
    try:
        temporary.write_bytes(b"" if data is None else data)
        os.replace(temporary, copy.with_name(f"{copy.name}.absent") if data is None else copy)
    except OSError:
        pass  # the node's other ranks wait WAIT_S, then read the run dir themselves
    return data


def _copy(path: Path) -> tuple[bytes | None] | None:
    """(the shared bytes,) from the node's copy, (None,) when the run dir had none; None while there is none."""
    try:
        return (path.read_bytes(),)
    except OSError:
        pass
    return (None,) if path.with_name(f"{path.name}.absent").exists() else None


def _read(source: Path) -> bytes | None:
    try:
        return source.read_bytes()
    except OSError:
        return None
