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
:mod:`hpc_ddp.rank.state.snapshot_load`) is the rank's; this folder is plain file handling,
and imports torch only to load. One module a job: committing a step, taking one back and
choosing and reading what to resume from in :mod:`hpc_ddp.rundir.snapshot.store`; which steps
are committed in :mod:`hpc_ddp.rundir.snapshot.steps` (no torch: ``status`` and the batch shell
read only that); a node file is written by :mod:`hpc_ddp.rundir.snapshot.write` and its bytes
checked by :mod:`hpc_ddp.rundir.snapshot.verify`. The names below are the folder's public face
(``from hpc_ddp.rundir import snapshot``; docs/reference.md); the writer is imported from its
module, as before.
"""

from __future__ import annotations

from hpc_ddp.rundir.snapshot.steps import (MANIFEST, REFUSES_RESIZE, WITHDRAWN, agreed, committed,
                                           committed_steps, step_dir)
from hpc_ddp.rundir.snapshot.store import (FILE_KEYS, Choice, SnapshotError, Unverified, Verify,
                                           choose, commit, load_file, node_file_name, read_state,
                                           verify_here, withdraw, write_atomic)
from hpc_ddp.rundir.snapshot.verify import file_problem

__all__ = ["FILE_KEYS", "MANIFEST", "REFUSES_RESIZE", "WITHDRAWN", "Choice", "SnapshotError",
           "Unverified", "Verify", "agreed", "choose", "commit", "committed", "committed_steps",
           "file_problem", "load_file", "node_file_name", "read_state", "step_dir", "verify_here",
           "withdraw", "write_atomic"]
