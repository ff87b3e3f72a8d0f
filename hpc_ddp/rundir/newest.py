"""``RUN_DIR/snapshots/newest.json``: the newest commit named in one file, so that a node can learn
of a step another node committed seconds ago without trusting a cached listing or lookup.

Every commit (a periodic snapshot's, the survivors') rewrites it in place after its manifest. Rank 0
creates it before the rendezvous, so no node ever looked the name up while it was absent, and an
open by name always reaches the server (close-to-open): the content is as new as the last writer's
close. A manifest it names that this node cannot see yet (its client cached the name's absence)
becomes visible within ``acdirmax``; the resume waits that long for it rather than resuming from an
older step (:func:`hpc_ddp.rundir.snapshot.steps.committed`). No torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp.core import atomic
from hpc_ddp.rundir import layout, view

NAME = "newest.json"
WIDTH = 256  # fixed: a rewrite in place replaces the whole record


def path(run_dir: Path | str) -> Path:
    return layout.snapshots(run_dir) / NAME


def create(run_dir: Path | str) -> None:
    """Rank 0, before the rendezvous: the file exists before any node looks for it (kept if it
    does)."""
    target = path(run_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        # its block now: a rewrite on a full filesystem needs no new one
        if os.fstat(fd).st_size == 0:
            os.pwrite(fd, b" " * (WIDTH - 1) + b"\n", 0)
    finally:
        os.close(fd)


def publish(run_dir: Path | str, step: int, attempt: str | None = None,
            standing: Callable[[int], bool] | None = None) -> None:
    """After a commit: name its step (in place, one fixed width; created if rank 0 had not), unless
    a newer step is named whose commit still stands (``standing``: its manifest is readable, not
    withdrawn): the newest step wins, not the last writer (issue 57), as the resume's own choice
    does. A commit may come after a newer one: a survivors' snapshot finished late, say."""
    named = read(run_dir)
    if named is not None and named["step"] > step and (standing is None
                                                       or standing(named["step"])):
        return
    record = json.dumps({"step": step, **({"attempt": attempt} if attempt else {})}, sort_keys=True)
    atomic.rewrite_in_place(path(run_dir), (record.ljust(WIDTH - 1)[:WIDTH - 1] + "\n").encode(),
                            sync=True)


def read(run_dir: Path | str) -> dict[str, Any] | None:
    """The newest commit's record ({"step": S, ...}), or None: none yet, or unreadable."""
    try:
        record = json.loads(view.current().read_bytes(path(run_dir)).decode().strip() or "null")
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None
