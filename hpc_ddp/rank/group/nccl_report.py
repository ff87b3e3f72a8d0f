"""Rank 0 learns which network NCCL chose between nodes, without the user setting NCCL_DEBUG.

:func:`prepare` (before the process group starts, on rank 0 of an NCCL job across nodes, where the
user set no ``NCCL_DEBUG``) points NCCL's INIT and NET lines at a file of its own on node-local
storage;
:func:`collect` (once the first communicator exists) reads that file, keeps what
:func:`hpc_ddp.core.nccl_net.parse` finds in :data:`FOUND` for the attempt's ledger line, logs it,
and warns when it is sockets on a node with InfiniBand devices. ``dev/nccl_net_check.py`` runs both
at world size 1 on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from hpc_ddp.core import nccl_net
from hpc_ddp.core.slurm_env import DistEnv

log = logging.getLogger("hpc_ddp.distributed")
IB_CLASS = Path("/sys/class/infiniband")
# what the last collect found, for the attempt's ledger line (rank 0)
FOUND: dict[str, Any] | None = None


def wanted(backend: str, env: DistEnv) -> bool:
    """On NCCL across nodes only: within a node NCCL uses no network."""
    return backend == "nccl" and env.num_nodes > 1


def prepare(target: MutableMapping[str, str], env: DistEnv, folder: str | None = None,
            user: Mapping[str, str] | None = None) -> str | None:
    """Rank 0: export the variables that send NCCL's INIT/NET lines to a file; its name's prefix
    (None: none). ``user``: variables the user set that are not in ``target`` yet
    (``dist.nccl_env``, for a script's child)."""
    global FOUND
    FOUND = None
    if not env.is_main:
        return None
    # a private folder of a name nobody can guess (mkdtemp: 0700): NCCL opens the file by name,
    # following links
    where = folder or tempfile.mkdtemp(prefix=f"hpc_ddp-{os.getuid()}-nccl-")
    prefix = str(Path(where) / f"nccl-{env.job_id}-{env.restart_count}")
    exports = nccl_net.capture_env({**target, **(user or {})}, f"{prefix}.%h.%p")
    target.update(exports)
    if not exports and folder is None:
        os.rmdir(where)  # the user's own NCCL_DEBUG: nothing of ours goes there
    return prefix if exports else None


def collect(prefix: str | None, ib_class: Path = IB_CLASS,
            pid: int | None = -1) -> dict[str, Any] | None:
    """Read and remove this process's file (NCCL names it PREFIX.HOST.PID; ``pid=None``: any
    process's, a ``train.script``'s child), log what NCCL chose and warn about sockets beside
    InfiniBand; the finding, also kept in :data:`FOUND`."""
    global FOUND
    if prefix is None:
        return None
    text = ""
    pid = os.getpid() if pid == -1 else pid
    pattern = f"{Path(prefix).name}.*.{'*' if pid is None else pid}"
    for path in sorted(Path(prefix).parent.glob(pattern)):
        try:
            text += path.read_text(errors="replace")
            # NCCL keeps it open and may add lines for later communicators: they go nowhere seen
            path.unlink()
        except OSError:
            continue
    if Path(prefix).parent.name.startswith(f"hpc_ddp-{os.getuid()}-nccl-"):
        with contextlib.suppress(OSError):
            # our own folder, once NCCL's files are read (not while a child writes)
            Path(prefix).parent.rmdir()
    FOUND = nccl_net.parse(text)
    if FOUND is None:
        log.info("NCCL did not say which network it uses between nodes (no INIT/NET lines in %s.*)",
                 prefix)
        return None
    log.info("NCCL between nodes: %s", nccl_net.summary(FOUND))
    said = nccl_net.warning(FOUND, ib_devices(ib_class))
    if said:
        FOUND["warning"] = said.split("\n")[0]
        log.warning("%s", said)
    return FOUND


def ib_devices(ib_class: Path = IB_CLASS) -> list[str]:
    """This node's InfiniBand (and RoCE, EFA) devices: /sys/class/infiniband's entries."""
    try:
        return sorted(entry.name for entry in ib_class.iterdir())
    except OSError:
        return []
