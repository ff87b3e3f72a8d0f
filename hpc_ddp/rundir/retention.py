"""Which step directories stay in ``RUN_DIR/snapshots``: the newest ``snapshot.keep_last`` committed steps,
and nothing that can never be resumed from. Deleting is this module's alone; what a step holds and how it is
committed is :mod:`hpc_ddp.rundir.snapshot`'s."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from hpc_ddp.rundir import layout
from hpc_ddp.rundir.snapshot import MANIFEST, committed_steps

log = logging.getLogger("hpc_ddp.snapshot")


def _steps(run_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in sorted(layout.snapshots(run_dir).glob("step-*")):
        try:
            found.append((int(entry.name.split("-", 1)[1]), entry))
        except ValueError:
            continue
    return found


def drop_uncommitted(run_dir: Path) -> dict[int, int]:
    """At the start of an attempt, before it writes anything: step directories that hold files but no manifest
    (a just-in-time snapshot whose set never completed, a write cut short by the end of its attempt) can never
    be resumed from, and :func:`prune` keeps those newer than the newest commit, which may be every one of
    them. Returns {step: bytes freed}, and logs them. A step with a manifest, even an unreadable one, stays:
    resume says why it skips it, and its files are the evidence. Never raises: a leftover costs disk, not
    correctness, so no resume fails for it."""
    dropped: dict[int, int] = {}
    try:
        for step, entry in _steps(run_dir):
            if entry.is_dir() and not (entry / MANIFEST).exists():
                dropped[step] = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
                shutil.rmtree(entry, ignore_errors=True)
    except OSError as err:
        log.warning("could not remove uncommitted snapshot files: %s", err)
    if dropped:
        log.info("removed the files of step(s) %s: never committed (a just-in-time snapshot whose set was "
                 "incomplete, or a write cut short), so no resume could use them (%.1f MB)",
                 ", ".join(map(str, dropped)), sum(dropped.values()) / 2**20)
    return dropped


def prune(run_dir: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` committed steps; drop older ones and stale uncommitted leftovers."""
    committed = committed_steps(run_dir)
    if not committed:
        return
    keep = set(committed[:max(keep_last, 1)])  # the newest committed step is never deleted
    for step, entry in _steps(run_dir):
        if step not in keep and step < committed[0]:
            (entry / MANIFEST).unlink(missing_ok=True)  # uncommit first: a half-deleted step never counts
            shutil.rmtree(entry, ignore_errors=True)
