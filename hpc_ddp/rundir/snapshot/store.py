"""Storing a step: a node file's atomic write, the manifest that commits the step, taking one
back, and choosing and reading what a resume starts from.

Every file is written to a temporary name, fsynced, renamed, and the directory fsynced, so a crash
at any point leaves the last committed step intact; the manifest is written last, by global rank
0: a step without a valid manifest does not exist. Loads use ``torch.load(weights_only=True)``: a
file that needs arbitrary unpickling is refused, nothing in it runs. Plain file handling, torch
imported only to load. The format as a whole: :mod:`hpc_ddp.rundir.snapshot`.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from hpc_ddp.core import atomic
from hpc_ddp.rundir import newest, slicing
from hpc_ddp.core.errors import HpcDdpError, explain
from hpc_ddp.rundir.snapshot.steps import (MANIFEST, REFUSES_RESIZE, WITHDRAWN, agreed, committed,
                                           read_manifest, step_dir)
from hpc_ddp.rundir.snapshot.verify import file_problem

log = logging.getLogger("hpc_ddp.snapshot")
# Tests only: "POINT:STEP[:SIGNAL]" with POINT one of tmp, before_rename, before_manifest: at that
# point of the write of that step this process gets SIGNAL (default KILL, as if killed there; TERM
# or USR2: a stop mid-write).
FAULT_POINT: str | None = None


class SnapshotError(HpcDdpError):
    """A snapshot cannot be written or read."""

    retry_may_help = True  # a full or failing filesystem: once space is freed, a requeue succeeds


class Unverified(SnapshotError):
    """A committed step's bytes did not verify as they were read (no copy of a slice, or a file's
    records): a resume takes the step before."""


def _fault(point: str, path: Path) -> None:
    """Fault injection for tests: a signal to this process at this point of the write of that
    step."""
    if not FAULT_POINT:
        return
    where, _, rest = FAULT_POINT.partition(":")
    step, _, name = rest.partition(":")
    if where == point and step and path.parent.name == f"step-{int(step):08d}":
        os.kill(os.getpid(), getattr(signal, f"SIG{name or 'KILL'}"))


def node_file_name(node_rank: int) -> str:
    return f"node-{node_rank:05d}.pt"


def write_atomic(path: Path, data: bytes | memoryview | Callable[[BinaryIO], None]) -> None:
    """:func:`hpc_ddp.core.atomic.write_atomic` with the fault seam, and a SnapshotError that says
    what to do."""
    try:
        atomic.write_atomic(path, data, fault=lambda point: _fault(point, path))
    except OSError as err:
        raise SnapshotError(explain(f"cannot write {path}: {err.strerror}",
                                    hint="check free space and permissions of the run directory; "
                                    "the previous committed snapshot is untouched")) from None


# what the manifest keeps of a writer's entry
FILE_KEYS = ("size", "sha256", "digests", "slices", "ranks")


def commit(directory: Path, step: int, entries: list[dict[str, Any]], world_size: int,
           config_hash: str,
           config: dict[str, Any] | None = None, split: dict[str, Any] | None = None,
           refuses_resize: str | None = None, extra: dict[str, Any] | None = None) -> None:
    """Write the manifest: from now on the step exists. ``config``: the config that wrote it, as
    :func:`hpc_ddp.core.config.flat_values` (a resume with another config says what changed);
    ``split``: the layout of the replicated state over the files
    (:func:`hpc_ddp.rundir.slicing.layout_for`); ``refuses_resize``: why the run cannot resume at
    another world size (:func:`refuses_resize`); ``extra``: more keys (a just-in-time snapshot's
    ``jit``: who wrote it, after what)."""
    _fault("before_manifest", directory / MANIFEST)
    manifest = {"step": step, "world_size": world_size, "num_nodes": len(entries),
                "config_hash": config_hash,
                **({"config": config} if config is not None else {}), "created": time.time(),
                "files": {e["name"]: {k: e[k] for k in FILE_KEYS if k in e} for e in entries},
                **({"layout": split} if split is not None else {}),
                **({REFUSES_RESIZE: refuses_resize} if refuses_resize else {}), **(extra or {})}
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    # after the commit: a node that cached the manifest's absence learns of it here
    # (rundir/newest.py)
    try:
        jit = (extra or {}).get("jit")
        run_dir = directory.parent.parent
        newest.publish(run_dir, step, jit.get("attempt") if isinstance(jit, dict) else None,
                       standing=lambda named: read_manifest(step_dir(run_dir, named)) is not None)
    except OSError as err:
        log.warning("step %d is committed, but %s could not name it (%s): another node may resume "
                    "from an older "
                    "step until its view of the run dir catches up", step,
                    newest.path(directory.parent.parent), err)


def withdraw(directory: Path, why: str) -> None:
    """Take a committed step back (survivors that disagree on its state). The mark goes into the
    manifest's own file first, rewritten in place: a node whose cache still maps the name to that
    file reads the mark, which a rename alone would not show it. Then the name goes
    (``manifest.json.withdrawn``). A reader that catches the rewrite half-way reads no manifest,
    which is what it should read."""
    path = directory / MANIFEST
    with open(path, "r+b") as out:
        manifest = json.loads(out.read())
        out.seek(0)
        out.write(json.dumps({**manifest, WITHDRAWN: why}, indent=1).encode())
        out.truncate()
        out.flush()
        os.fsync(out.fileno())
    os.replace(path, directory / f"{MANIFEST}.withdrawn")
    atomic.fsync_dir(directory)


@dataclass(frozen=True)
class Choice:
    """What to resume from: a committed step, its files that verified, and which to read each slice
    from."""

    step: int
    directory: Path
    good_files: tuple[str, ...]
    manifest: dict[str, Any]
    sources: dict[int, str]  # slice -> a good file that holds it (format 1: slice 0, a whole copy)


Verify = Callable[[Path, dict[str, Any]], dict[str, "str | None"]]


def verify_here(directory: Path, manifest: dict[str, Any]) -> dict[str, str | None]:
    """Every file of the step checked by this process: {name: problem or None}."""
    files = manifest.get("files", {})
    return {name: file_problem(directory, name, e if isinstance(e, dict) else {})
            for name, e in sorted(files.items())}


def choose(run_dir: Path, verify: Verify = verify_here,
           found: list[tuple[int, dict[str, Any]]] | None = None,
           warn: Callable[..., None] = log.warning, ranks_needed: int = 0) -> Choice | None:
    """The newest committed step of which every slice has a file that verifies; warn about every bad
    file.

    ``verify`` checks a step's files (the checkpointer spreads that over the ranks); ``found``: the
    committed steps, when already read; ``ranks_needed``: the world size when ``per_rank`` objects
    are tracked (each rank's state has no other copy: a step written at that size whose file of a
    rank's state is bad is skipped, as one with a bad slice is; without them a rank's RNG is
    reseeded). None when there is no committed step (a fresh start). When there are committed steps
    but none can be restored, raise: starting over would silently throw the run away, and its
    snapshots might be restorable from a backup.
    """
    bad: list[str] = []
    for step, manifest in agreed(run_dir, committed(run_dir), warn) if found is None else found:
        directory = step_dir(run_dir, step)
        problem = slicing.layout_problem(manifest)
        if problem:
            warn("snapshot manifest %s is not usable (%s)", directory / MANIFEST, problem)
            bad.append(f"{directory / MANIFEST} ({problem})")
            continue
        verdicts = verify(directory, manifest)
        for name, why in sorted(verdicts.items()):
            if why:
                warn("snapshot file %s is not usable (%s)", directory / name, why)
                bad.append(f"{directory / name} ({why})")
        good = tuple(name for name, why in sorted(verdicts.items()) if why is None)
        sources = slicing.sources(manifest, good) if good else None
        lacking = sorted(r for r in range(ranks_needed) if (f := slicing.rank_file(manifest, r))
                         and f not in good)
        if sources is not None and lacking and manifest.get("world_size") == ranks_needed:
            warn("committed snapshot step %d has no usable file of the per_rank state of rank(s) "
                 "%s; trying the "
                 "one before", step, lacking)
            continue
        if sources is not None:
            return Choice(step, directory, good, manifest, sources)
        warn("committed snapshot step %d has no usable copy of %s; trying the one before", step,
             "its files" if not good else "every slice")
    if bad:
        raise SnapshotError(explain(f"no committed snapshot of {run_dir} verifies: "
                                    f"{'; '.join(bad[:4])}"
                                    + (f" and {len(bad) - 4} more" if len(bad) > 4 else ""),
                                    hint="restore the files from a backup, or move "
                                         f"{run_dir / 'snapshots'} "
                                    "away to start the run over"))
    return None


def load_file(path: Path) -> dict[str, Any]:
    """Load a node file with weights_only=True; refuse anything that needs arbitrary unpickling."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True,
                          mmap=True)  # type: ignore[no-any-return]
    except pickle.UnpicklingError as err:
        raise SnapshotError(explain(f"refused to load snapshot file {path}: it needs arbitrary "
                                    "unpickling, "
                                    f"which could run code ({str(err).splitlines()[0][:120]})",
                                    hint="snapshots hold tensors and plain values only; delete "
                                         "this step "
                                    "directory if you did not write it")) from None


def read_state(choice: Choice, also: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the replicated state, {name: loaded file}) of a chosen step: one good file per slice, plus
    ``also`` (the file of a rank's RNG state). Not collective: a notebook can read a run's newest
    snapshot with ``read_state(choose(run_dir))[0]``."""
    split = choice.manifest.get("layout")
    needed = {choice.sources[0]} if split is None else set(choice.sources.values())
    files = {name: load_file(choice.directory / name)
             for name in sorted(needed | ({also} if also else set()))}
    if split is None:  # format 1: every file holds the whole replicated state
        return files[choice.sources[0]]["replicated"], files
    try:
        pieces = {index: files[choice.sources[owner]]["pieces"][index]
                  for index, (_, _, _, owner) in enumerate(split["pieces"])}
        return slicing.assemble(split, files[choice.sources[0]]["skeleton"], pieces), files
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise SnapshotError(explain(f"the files of step {choice.step} in {choice.directory} do not "
                                    "hold what its "
                                    f"manifest says ({err!r})",
                                    hint="move this step directory away to resume "
                                    "from the one before")) from None
