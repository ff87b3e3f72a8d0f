"""Per-node snapshot files, the manifest that commits them, and choosing what to resume from.

Layout: ``RUN_DIR/snapshots/step-00000123/node-00000.pt`` (one per node, written by
its local rank 0: its slices of the replicated state, see :mod:`hpc_ddp.rundir.slicing`, and
its ranks' RNG states) and ``manifest.json`` (files with their sizes, sha256, slices
and ranks; the layout; step, world size, config), written last by global rank 0: a
step without a valid manifest does not exist. Every file is written to a temporary
name, fsynced, renamed, and the directory fsynced, so a crash at any point leaves the
last committed step intact. Loads use ``torch.load(weights_only=True)``: a file that
needs arbitrary unpickling is refused, nothing in it runs. The collective part (who
writes what: :mod:`hpc_ddp.rank.state.checkpointer`; who verifies and reads what:
:mod:`hpc_ddp.rank.state.snapshot_load`) is the rank's; this module is
plain file handling, and imports torch only to load (``status`` reads manifests without it). A node
file is written by :mod:`hpc_ddp.rundir.snapshot_write` and its bytes checked by
:mod:`hpc_ddp.rundir.snapshot_verify`.
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
from hpc_ddp.rundir import jit_files, layout, newest, slicing, view
from hpc_ddp.core.errors import HpcDdpError, explain
from hpc_ddp.rundir.snapshot_verify import file_problem

log = logging.getLogger("hpc_ddp.snapshot")
MANIFEST = "manifest.json"
WITHDRAWN = "withdrawn"  # a manifest key: the step was taken back (why), whatever name a cache still shows
REFUSES_RESIZE = "refuses_resize"  # the manifest's key: why the run cannot resume at another world size
# its reasons are joined by REASONS_JOIN; the per-rank state's starts with PER_RANK_REASON (rank/state/tracked.py)
REASONS_JOIN, PER_RANK_REASON = "; ", "the per-rank state "
# Tests only: "POINT:STEP[:SIGNAL]" with POINT one of tmp, before_rename, before_manifest: at that point of the
# write of that step this process gets SIGNAL (default KILL, as if killed there; TERM or USR2: a stop mid-write).
FAULT_POINT: str | None = None


class SnapshotError(HpcDdpError):
    """A snapshot cannot be written or read."""

    retry_may_help = True  # a full or failing filesystem: once space is freed, a requeue succeeds


class Unverified(SnapshotError):
    """A committed step's bytes did not verify as they were read (no copy of a slice, or a file's records): a
    resume takes the step before."""


def _fault(point: str, path: Path) -> None:
    """Fault injection for tests: a signal to this process at this point of the write of that step."""
    if not FAULT_POINT:
        return
    where, _, rest = FAULT_POINT.partition(":")
    step, _, name = rest.partition(":")
    if where == point and step and path.parent.name == f"step-{int(step):08d}":
        os.kill(os.getpid(), getattr(signal, f"SIG{name or 'KILL'}"))


def step_dir(run_dir: Path, step: int) -> Path:
    return layout.snapshots(run_dir) / f"step-{step:08d}"


def node_file_name(node_rank: int) -> str:
    return f"node-{node_rank:05d}.pt"


def write_atomic(path: Path, data: bytes | memoryview | Callable[[BinaryIO], None]) -> None:
    """:func:`hpc_ddp.core.atomic.write_atomic` with the fault seam, and a SnapshotError that says what to do."""
    try:
        atomic.write_atomic(path, data, fault=lambda point: _fault(point, path))
    except OSError as err:
        raise SnapshotError(explain(f"cannot write {path}: {err.strerror}",
                                    hint="check free space and permissions of the run directory; "
                                    "the previous committed snapshot is untouched")) from None


FILE_KEYS = ("size", "sha256", "digests", "slices", "ranks")  # what the manifest keeps of a writer's entry


def commit(directory: Path, step: int, entries: list[dict[str, Any]], world_size: int, config_hash: str,
           config: dict[str, Any] | None = None, split: dict[str, Any] | None = None,
           refuses_resize: str | None = None, extra: dict[str, Any] | None = None) -> None:
    """Write the manifest: from now on the step exists. ``config``: the config that wrote it, as
    :func:`hpc_ddp.core.config.flat_values` (a resume with another config says what changed); ``split``:
    the layout of the replicated state over the files (:func:`hpc_ddp.rundir.slicing.layout_for`);
    ``refuses_resize``: why the run cannot resume at another world size (:func:`refuses_resize`);
    ``extra``: more keys (a just-in-time snapshot's ``jit``: who wrote it, after what)."""
    _fault("before_manifest", directory / MANIFEST)
    manifest = {"step": step, "world_size": world_size, "num_nodes": len(entries), "config_hash": config_hash,
                **({"config": config} if config is not None else {}), "created": time.time(),
                "files": {e["name"]: {k: e[k] for k in FILE_KEYS if k in e} for e in entries},
                **({"layout": split} if split is not None else {}),
                **({REFUSES_RESIZE: refuses_resize} if refuses_resize else {}), **(extra or {})}
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    try:  # after the commit: a node that cached the manifest's absence learns of it here (rundir/newest.py)
        jit = (extra or {}).get("jit")
        newest.publish(directory.parent.parent, step, jit.get("attempt") if isinstance(jit, dict) else None)
    except OSError as err:
        log.warning("step %d is committed, but %s could not name it (%s): another node may resume from an older "
                    "step until its view of the run dir catches up", step, newest.path(directory.parent.parent), err)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The step's manifest, or None: none, unreadable, or withdrawn (:func:`withdraw`)."""
    try:
        manifest = json.loads(view.current().read_bytes(directory / MANIFEST))
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and isinstance(
        manifest.get("step"), int) and WITHDRAWN not in manifest
    return manifest if ok else None


def withdraw(directory: Path, why: str) -> None:
    """Take a committed step back (survivors that disagree on its state). The mark goes into the manifest's own
    file first, rewritten in place: a node whose cache still maps the name to that file reads the mark, which a
    rename alone would not show it. Then the name goes (``manifest.json.withdrawn``). A reader that catches the
    rewrite half-way reads no manifest, which is what it should read."""
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


# How long an NFS client may keep a name's absence (acdirmax, 60 s by default), and a margin.
NAME_CACHE_S = 65.0


def committed(run_dir: Path, wait_s: float = 0.0, sleep: Callable[[float], None] = time.sleep
              ) -> list[tuple[int, dict[str, Any]]]:
    """(step, manifest) of every step with a readable manifest, newest first.

    The listing of ``snapshots/`` and a lookup of a manifest can both be another node's cached view; the
    newest commit's own file cannot (:mod:`hpc_ddp.rundir.newest`). When it names a step newer than any this
    node sees, that step's manifest is read by name again for up to ``wait_s`` (the resume passes
    :data:`NAME_CACHE_S`): the survivors' snapshot committed on another node seconds ago is found, not skipped
    for an older step."""
    root = layout.snapshots(run_dir)
    try:
        names = [n for n in view.current().listdir(root) if n.startswith("step-")]
    except OSError:
        names = []
    found = []
    for name in names:
        manifest = read_manifest(root / name)
        if manifest is not None and name == f"step-{manifest['step']:08d}":
            found.append((manifest["step"], manifest))
    named = newest.read(run_dir)
    if named is not None and named["step"] > max((step for step, _ in found), default=-1):
        manifest = _named(step_dir(run_dir, named["step"]), wait_s, sleep)
        if manifest is not None and manifest["step"] == named["step"]:
            found.append((named["step"], manifest))
    return sorted(found, key=lambda pair: pair[0], reverse=True)


def _named(directory: Path, wait_s: float, sleep: Callable[[float], None]) -> dict[str, Any] | None:
    """The manifest of the step the newest commit names, read by name until this node sees it (``wait_s``);
    None at once for a withdrawn step."""
    waited = 0.0
    while (manifest := read_manifest(directory)) is None and waited < wait_s and not _withdrawn(directory):
        if not waited:
            log.warning("%s names %s as committed, but its manifest is not visible from this node yet (a cached "
                        "view of the run dir); reading it again for up to %.0f s",
                        newest.path(directory.parent.parent), directory.name, wait_s)
        sleep(1.0)
        waited += 1.0
    if manifest is None and waited >= wait_s > 0:
        log.warning("the manifest of %s did not become visible within %.0f s (removed by hand?): resuming from "
                    "an older step", directory, wait_s)
    return manifest


def _withdrawn(directory: Path) -> bool:
    for name in (MANIFEST, f"{MANIFEST}.withdrawn"):
        try:
            if WITHDRAWN in json.loads(view.current().read_bytes(directory / name)):
                return True
        except (OSError, ValueError, TypeError):
            continue
    return False


def agreed(run_dir: Path, found: list[tuple[int, dict[str, Any]]],
           warn: Callable[..., None] = log.warning) -> list[tuple[int, dict[str, Any]]]:
    """``found`` without the survivors' snapshots that a survivor's offer disagrees with
    (:func:`hpc_ddp.rundir.jit_files.disagreeing`): as if withdrawn. Read on one rank (rank 0), whose list
    every rank then takes: the offers are files another node may see otherwise."""
    kept = []
    for step, manifest in found:
        differ = jit_files.disagreeing(run_dir, manifest)
        if differ:
            warn("the survivors' snapshot of step %d is not used: rank(s) %s offered another state of it than its "
                 "writer, rank %s (a replicated object that differs by rank?)", step, differ,
                 manifest["jit"].get("writer"))
            continue
        kept.append((step, manifest))
    return kept


def committed_steps(run_dir: Path) -> list[int]:
    """Steps with a readable manifest, newest first."""
    return [step for step, _ in committed(run_dir)]


def refuses_resize(run_dir: Path, per_rank_only: bool = False) -> str | None:
    """Why the run in ``run_dir`` cannot resume at another world size (naming the per-rank state that refuses
    it, or the global batch that would change), or None when it can (or has no snapshot: a fresh start can
    run at any size). From the newest committed manifest; no torch, for the batch shell: a heal by fewer
    nodes would only be refused by every rank of the new step. ``per_rank_only``: the per-rank reason alone
    (the batch reason was recorded under the config that wrote the snapshot; a --resume checks its own)."""
    found = committed(run_dir)
    reason = found[0][1].get(REFUSES_RESIZE) if found else None
    if not isinstance(reason, str) or not reason:
        return None
    if per_rank_only:
        reason = REASONS_JOIN.join(r for r in reason.split(REASONS_JOIN) if r.startswith(PER_RANK_REASON))
    return reason or None


@dataclass(frozen=True)
class Choice:
    """What to resume from: a committed step, its files that verified, and which to read each slice from."""

    step: int
    directory: Path
    good_files: tuple[str, ...]
    manifest: dict[str, Any]
    sources: dict[int, str]  # slice -> a good file that holds it (format 1: slice 0, a whole copy)


Verify = Callable[[Path, dict[str, Any]], dict[str, "str | None"]]


def verify_here(directory: Path, manifest: dict[str, Any]) -> dict[str, str | None]:
    """Every file of the step checked by this process: {name: problem or None}."""
    files = manifest.get("files", {})
    return {name: file_problem(directory, name, e if isinstance(e, dict) else {}) for name, e in sorted(files.items())}


def choose(run_dir: Path, verify: Verify = verify_here, found: list[tuple[int, dict[str, Any]]] | None = None,
           warn: Callable[..., None] = log.warning, ranks_needed: int = 0) -> Choice | None:
    """The newest committed step of which every slice has a file that verifies; warn about every bad file.

    ``verify`` checks a step's files (the checkpointer spreads that over the ranks);
    ``found``: the committed steps, when already read; ``ranks_needed``: the world size when ``per_rank``
    objects are tracked (each rank's state has no other copy: a step written at that size whose file of a
    rank's state is bad is skipped, as one with a bad slice is; without them a rank's RNG is reseeded). None when there is no committed
    step (a fresh start). When there are committed steps but none can be restored,
    raise: starting over would silently throw the run away, and its snapshots might be
    restorable from a backup.
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
        lacking = sorted(r for r in range(ranks_needed) if (f := slicing.rank_file(manifest, r)) and f not in good)
        if sources is not None and lacking and manifest.get("world_size") == ranks_needed:
            warn("committed snapshot step %d has no usable file of the per_rank state of rank(s) %s; trying the "
                 "one before", step, lacking)
            continue
        if sources is not None:
            return Choice(step, directory, good, manifest, sources)
        warn("committed snapshot step %d has no usable copy of %s; trying the one before", step,
             "its files" if not good else "every slice")
    if bad:
        raise SnapshotError(explain(f"no committed snapshot of {run_dir} verifies: {'; '.join(bad[:4])}"
                                    + (f" and {len(bad) - 4} more" if len(bad) > 4 else ""),
                                    hint=f"restore the files from a backup, or move {run_dir / 'snapshots'} "
                                    "away to start the run over"))
    return None


def load_file(path: Path) -> dict[str, Any]:
    """Load a node file with weights_only=True; refuse anything that needs arbitrary unpickling."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # type: ignore[no-any-return]
    except pickle.UnpicklingError as err:
        raise SnapshotError(explain(f"refused to load snapshot file {path}: it needs arbitrary unpickling, "
                                    f"which could run code ({str(err).splitlines()[0][:120]})",
                                    hint="snapshots hold tensors and plain values only; delete this step "
                                    "directory if you did not write it")) from None


def read_state(choice: Choice, also: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the replicated state, {name: loaded file}) of a chosen step: one good file per slice, plus ``also``
    (the file of a rank's RNG state). Not collective: a notebook can read a run's newest snapshot with
    ``read_state(choose(run_dir))[0]``."""
    split = choice.manifest.get("layout")
    needed = {choice.sources[0]} if split is None else set(choice.sources.values())
    files = {name: load_file(choice.directory / name) for name in sorted(needed | ({also} if also else set()))}
    if split is None:  # format 1: every file holds the whole replicated state
        return files[choice.sources[0]]["replicated"], files
    try:
        pieces = {index: files[choice.sources[owner]]["pieces"][index]
                  for index, (_, _, _, owner) in enumerate(split["pieces"])}
        return slicing.assemble(split, files[choice.sources[0]]["skeleton"], pieces), files
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise SnapshotError(explain(f"the files of step {choice.step} in {choice.directory} do not hold what its "
                                    f"manifest says ({err!r})", hint="move this step directory away to resume "
                                    "from the one before")) from None
