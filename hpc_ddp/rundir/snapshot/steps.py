"""Which snapshot steps are committed, as this node sees them: each step's manifest read (by listing
``RUN_DIR/snapshots/``, and by name for the step the newest commit names, waited for while a
cached view hides it), withdrawn steps and survivors' snapshots that a survivor disagrees with
left out, and why the newest one refuses a resize. No torch: the login node, the batch shell and
``status`` read only this.

Apart from :mod:`hpc_ddp.rundir.snapshot.store`, which writes and commits a step's files, takes one
back and chooses and loads what a resume reads: finding the committed steps is a reader's job for
every place, where writing one is a rank's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import jit_offers, layout, newest, view

log = logging.getLogger("hpc_ddp.snapshot")
MANIFEST = "manifest.json"
# a manifest key: the step was taken back (why), whatever name a cache still shows
WITHDRAWN = "withdrawn"
# the manifest's key: why the run cannot resume at another world size
REFUSES_RESIZE = "refuses_resize"
# its reasons are joined by REASONS_JOIN; the per-rank state's starts with PER_RANK_REASON
# (rank/state/tracked.py)
REASONS_JOIN, PER_RANK_REASON = "; ", "the per-rank state "


def step_dir(run_dir: Path, step: int) -> Path:
    return layout.snapshots(run_dir) / f"step-{step:08d}"


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The step's manifest, or None: none, unreadable, or withdrawn
    (:func:`hpc_ddp.rundir.snapshot.store.withdraw`)."""
    try:
        manifest = json.loads(view.current().read_bytes(directory / MANIFEST))
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and isinstance(
        manifest.get("step"), int) and WITHDRAWN not in manifest
    return manifest if ok else None


# How long an NFS client may keep a name's absence (acdirmax, 60 s by default), and a margin.
NAME_CACHE_S = 65.0


def committed(run_dir: Path, wait_s: float = 0.0, sleep: Callable[[float], None] = time.sleep
              ) -> list[tuple[int, dict[str, Any]]]:
    """(step, manifest) of every step with a readable manifest, newest first.

    The listing of ``snapshots/`` and a lookup of a manifest can both be another node's cached view;
    the newest commit's own file cannot (:mod:`hpc_ddp.rundir.newest`). When it names a step newer
    than any this node sees, that step's manifest is read by name again for up to ``wait_s`` (the
    resume passes
    :data:`NAME_CACHE_S`): the survivors' snapshot committed on another node seconds ago is found,
    not skipped for an older step."""
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
    """The manifest of the step the newest commit names, read by name until this node sees it
    (``wait_s``); None at once for a withdrawn step."""
    waited = 0.0
    while ((manifest := read_manifest(directory)) is None and waited < wait_s
           and not _withdrawn(directory)):
        if not waited:
            log.warning("%s names %s as committed, but its manifest is not visible from this node "
                        "yet (a cached "
                        "view of the run dir); reading it again for up to %.0f s",
                        newest.path(directory.parent.parent), directory.name, wait_s)
        sleep(1.0)
        waited += 1.0
    if manifest is None and waited >= wait_s > 0:
        log.warning("the manifest of %s did not become visible within %.0f s (removed by hand?): "
                    "resuming from "
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
    (:func:`hpc_ddp.rundir.jit_offers.disagreeing`), or that a rank declared lost wrote or committed
    after its declaration (:func:`hpc_ddp.rundir.jit_offers.fenced`): as if withdrawn. Read on one
    rank (rank 0), whose list every rank then takes: the offers are files another node may see
    otherwise."""
    kept = []
    for step, manifest in found:
        fence = jit_offers.fence_of(run_dir, manifest)  # read once for both checks
        path = step_dir(run_dir, step) / MANIFEST
        late = jit_offers.fenced(manifest, fence, path) if fence else []
        if late:
            warn("the survivors' snapshot of step %d is not used: rank(s) %s wrote or committed it "
                 "after they were declared lost (a cut-off or thawed node's late write)", step,
                 late)
            continue
        differ = jit_offers.disagreeing(run_dir, manifest, fence)
        if differ:
            warn("the survivors' snapshot of step %d is not used: rank(s) %s offered another state "
                 "of it than its "
                 "writer, rank %s (a replicated object that differs by rank?)", step, differ,
                 manifest["jit"].get("writer"))
            continue
        kept.append((step, manifest))
    return kept


def committed_steps(run_dir: Path) -> list[int]:
    """Steps with a readable manifest, newest first."""
    return [step for step, _ in committed(run_dir)]


def refuses_resize(run_dir: Path, per_rank_only: bool = False) -> str | None:
    """Why the run in ``run_dir`` cannot resume at another world size (naming the per-rank state
    that refuses it, or the global batch that would change), or None when it can (or has no
    snapshot: a fresh start can run at any size). From the newest committed manifest; no torch, for
    the batch shell: a heal by fewer nodes would only be refused by every rank of the new step.
    ``per_rank_only``: the per-rank reason alone (the batch reason was recorded under the config
    that wrote the snapshot; a --resume checks its own)."""
    found = committed(run_dir)
    reason = found[0][1].get(REFUSES_RESIZE) if found else None
    if not isinstance(reason, str) or not reason:
        return None
    if per_rank_only:
        reason = REASONS_JOIN.join(r for r in reason.split(REASONS_JOIN)
                                   if r.startswith(PER_RANK_REASON))
    return reason or None
