"""Who writes and who commits a survivors' just-in-time snapshot (:mod:`hpc_ddp.rank.salvage.jit`):
claims that are exclusive creates, never a lookup that a stale cache could answer.

Who writes is decided on each node first (:func:`claim_on_node`: an exclusive create in the node's
folder, one writer of the node's share per step); where one survivor writes the whole state, that
node's winner also creates ``claim-step-S`` in the run dir with O_EXCL (atomic on local filesystems
and on NFS v3 and later). One ``commit`` file per attempt (O_EXCL again) names the one survivor that
puts the per-rank states together and commits; the batch shell seals it once the attempt's step
ended (:func:`seal`), so that no late process of the attempt commits. Apart from the node's offers
and their files (:mod:`hpc_ddp.rundir.jit_files`): the batch shell takes this claim without the
survivors' side, and the claims read nothing the offers say.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_ddp.core.atomic import NEW, rewrite_in_place
from hpc_ddp.rundir import node_local

if TYPE_CHECKING:
    from hpc_ddp.rundir.jit_post import Post


def claim(where: Path, step: int, what: str = "claim") -> bool:
    """True for the one survivor that creates ``claim-step-S`` first."""
    return exclusive(where / f"{what}-step-{step}")


def exclusive(path: Path, content: bytes = b"") -> bool:
    """Create ``path`` (and its folder) exclusively, holding ``content``: True for the one process
    that made it."""
    try:
        try:
            fd = os.open(path, NEW, 0o644)
        except FileNotFoundError:  # the folder's first file
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, NEW, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, content)
    except OSError:
        pass  # the claim is the name; its content only says why
    finally:
        os.close(fd)
    return True


# one per attempt: the survivor that commits its snapshot, or the seal that forbids it
COMMIT_CLAIM = "commit"


def claim_commit(where: Path, step: int) -> bool:
    """True for the one survivor that creates the attempt's ``commit`` file first (it then commits
    ``step``, which the file names). One per attempt, not per step: once a survivors' snapshot is
    committed, or the batch shell sealed the attempt (:func:`seal`), no process of it commits
    anything, however late it wakes (a partitioned node that still sees the run dir, a frozen one
    thawed). An exclusive create, which NFS and a cached view decide at the server: never a lookup
    that a stale cache could answer."""
    return exclusive(where / COMMIT_CLAIM, f"step {step}\n".encode())


def seal(where: Path) -> str:
    """The batch shell (or the rehearsal's launcher), once the attempt's step ended: take the
    attempt's commit claim so that no process of it commits later (fencing; :func:`claim_commit`).
    Returns "sealed", or what holds the claim ("step S" of a survivors' commit)."""
    if exclusive(where / COMMIT_CLAIM, b"sealed\n"):
        return "sealed"
    return commit_holder(where)


def commit_holder(where: Path) -> str:
    """What the attempt's commit claim says: "sealed", "step S" (a survivor commits or committed S),
    "failed: ..." (its commit raised), or "claimed" (created a moment ago, not yet written)."""
    held = node_local.read(where / COMMIT_CLAIM, 256, owner=None)
    return (held or b"").decode(errors="replace").strip() or "claimed"


def commit_failed(where: Path, why: str) -> None:
    """The committer's commit raised after it took the claim: the claim says so (never a step that
    is not there); padded to the width :func:`commit_holder` reads, so nothing of "step S" is left
    after it."""
    with contextlib.suppress(OSError):
        rewrite_in_place(where / COMMIT_CLAIM, (why[:254] + "\n").encode()[:255].ljust(256))


def claim_on_node(post: Post, step: int) -> bool:
    """True for the one rank of this node that claims ``step`` first, decided on the node (an
    exclusive create in its folder): only that rank then goes to the run dir (:func:`claim`), so a
    node's sources cost the file server one claim, not one each."""
    node_local.ensure(post.local)
    return claim(post.local, step, "node-claim")
