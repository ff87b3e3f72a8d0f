"""Which step directories stay in ``RUN_DIR/snapshots``: the newest ``snapshot.keep_last`` committed
steps, and nothing that can never be resumed from. Deleting is this module's alone; what a step
holds and how it is committed is :mod:`hpc_ddp.rundir.snapshot`'s."""

from __future__ import annotations

import logging
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

from hpc_ddp.rundir import layout, newest, view
from hpc_ddp.rundir.snapshot.steps import MANIFEST, committed_steps

log = logging.getLogger("hpc_ddp.snapshot")


def _steps(run_dir: Path) -> list[tuple[int, Path]]:
    found = []
    try:
        names = sorted(n for n in view.current().listdir(layout.snapshots(run_dir))
                       if n.startswith("step-"))
    except OSError:
        return []
    for name in names:
        try:
            found.append((int(name.split("-", 1)[1]), layout.snapshots(run_dir) / name))
        except ValueError:
            continue
    return found


# An NFS client caches names, absent ones too, and attributes for up to acdirmax (60 s by default):
# a manifest another node committed seconds ago may look absent here. A step directory without one
# is dropped only when its own listing says so and its newest file is older than this.
UNCOMMITTED_AGE_S = 120.0


def drop_uncommitted(run_dir: Path, min_age_s: float = UNCOMMITTED_AGE_S,
                     clock: Callable[[], float] = time.time) -> dict[int, int]:
    """At the start of an attempt, before it writes anything: step directories that hold files but
    no manifest (a just-in-time snapshot whose set never completed, a write cut short by the end of
    its attempt) can never be resumed from, and :func:`prune` keeps those newer than the newest
    commit, which may be every one of them. Returns {step: bytes freed}, and logs them. A step with
    a manifest, even an unreadable one, stays: resume says why it skips it, and its files are the
    evidence. Never raises: a leftover costs disk, not correctness, so no resume fails for it.

    "No manifest" is decided from the step directory's listing as this node sees it
    (:mod:`hpc_ddp.rundir.view`: on NFS a listing and a lookup can be another node's cached past),
    so never for the step the newest commit names (:mod:`hpc_ddp.rundir.newest`, read by name) nor
    when its newest file is younger than ``min_age_s``, longer than any client keeps a cached view:
    the survivors' snapshot a node committed just before this attempt started is exactly that case
    (issue 44). Such a leftover stays until a later attempt."""
    dropped: dict[int, int] = {}
    young: list[int] = []
    # the newest commit says so itself, whatever the listing shows
    named = newest.read(run_dir) or {}
    try:
        for step, entry in _steps(run_dir):
            if step == named.get("step"):
                continue
            sizes = _uncommitted_files(entry, clock() - min_age_s)
            if sizes is None:
                continue
            if not sizes[1]:
                young.append(step)
                continue
            dropped[step] = sizes[0]
            shutil.rmtree(entry, ignore_errors=True)
    except OSError as err:
        log.warning("could not remove uncommitted snapshot files: %s", err)
    if dropped:
        log.info("removed the files of step(s) %s: never committed (a just-in-time snapshot whose "
                 "set was "
                 "incomplete, or a write cut short), so no resume could use them (%.1f MB)",
                 ", ".join(map(str, dropped)), sum(dropped.values()) / 2**20)
    if young:
        log.info("kept the files of step(s) %s: no manifest seen, but written within %.0f s "
                 "(another node's "
                 "commit may not be visible here yet); a later attempt removes them if they stay "
                 "uncommitted",
                 ", ".join(map(str, young)), min_age_s)
    return dropped


def _uncommitted_files(entry: Path, written_before: float) -> tuple[int, bool] | None:
    """(bytes, whether every file was written before ``written_before``) of a step directory whose
    own listing holds no manifest; None for a committed step or what is no step directory."""
    seen = view.current()
    try:
        names = seen.listdir(entry)
        if MANIFEST in names:
            return None
        total, latest = 0, seen.stat(entry).st_mtime
        pending = [entry / name for name in names]
        while pending:
            path = pending.pop()
            info = seen.stat(path)
            if stat.S_ISDIR(info.st_mode):
                pending.extend(path / name for name in seen.listdir(path))
            total, latest = total + info.st_size, max(latest, info.st_mtime)
    except OSError:  # not a directory, or gone
        return None
    return total, latest < written_before


def prune(run_dir: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` committed steps; drop older ones and stale uncommitted
    leftovers."""
    committed = committed_steps(run_dir)
    if not committed:
        return
    keep = set(committed[:max(keep_last, 1)])  # the newest committed step is never deleted
    for step, entry in _steps(run_dir):
        if step not in keep and step < committed[0]:
            # uncommit first: a half-deleted step never counts
            (entry / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(entry, ignore_errors=True)
