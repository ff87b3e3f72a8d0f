"""The survivors' files of earlier attempts go once nothing can use them (issue 57: a tidy run dir).

Every attempt makes ``RUN_DIR/jit/<attempt>/`` (its nodes' offer files and the broken-stop mark are
created before the rendezvous), and a failure adds each node's per-rank states: at 4,096 ranks with
a 50 MB prefetched batch, hundreds of GB a failure, kept for ever. The batch shell (and the
rehearsal's launcher) calls :func:`prune` as it settles a step; for every other attempt's folder:

- the attempt is **sealed** first (:func:`hpc_ddp.rundir.jit_claims.seal`), so no process of it
  commits later, however late it wakes; a claim created a moment ago and not yet written is left
  for the next settle;
- everything but the ``commit`` claim is removed: the per-rank blobs, the claims, the marks, the
  steps' tallies and the nodes' offers. The claim stays: it is the fence (an exclusive create that
  found no file would succeed, and a partitioned node's late commit would count). One 7-byte file an
  attempt.
- the nodes' offers stay while a committed survivors' snapshot of that attempt is still kept:
  a resume reads them to refuse one that a survivor disagreed with
  (:func:`hpc_ddp.rundir.jit_offers.disagreeing`).

The attempt being settled keeps its folder whole: its ledger line, status and a person read it.
A listing of ``jit/`` that another node's cache shortened only leaves a folder for the next settle.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpc_ddp.rundir.jit_claims import COMMIT_CLAIM, seal
from hpc_ddp.rundir.jit_files import JIT
from hpc_ddp.rundir.snapshot.steps import committed


def prune(run_dir: Path | str, current: str) -> list[str]:
    """Remove what the attempts other than ``current`` (a tag, ``job-J-restart-R[-step-K]``) left in
    ``RUN_DIR/jit`` and nothing can use; returns the paths removed, relative to the run dir."""
    root = Path(run_dir) / JIT
    try:
        names = sorted(n for n in os.listdir(root) if n != current)
    except OSError:
        return []
    if not names:
        return []
    # attempts whose survivors' snapshot is still kept: a resume checks their offers
    checked = {m["jit"].get("attempt") for _, m in committed(Path(run_dir))
               if isinstance(m.get("jit"), dict)}
    removed = []
    for name in names:
        where = root / name
        if not where.is_dir() or seal(where) == "claimed":
            continue
        for entry in os.scandir(where):
            offer = entry.name.startswith("node-") and entry.name.endswith(".json")
            if entry.name == COMMIT_CLAIM or (offer and name in checked):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):  # a step's tally (rundir/jit_tally.py)
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                continue  # gone already, or not ours to remove: the next settle tries again
            removed.append(f"{JIT}/{name}/{entry.name}")
    return removed

