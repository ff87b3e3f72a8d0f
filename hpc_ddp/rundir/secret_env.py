"""The run's secret handed from a launcher to the ranks it starts, in their environment (issue 59).

Every process of a run needs the run's secret (:mod:`hpc_ddp.rundir.node_local`: the node-local
folders' names, the attempt's tokens), and each read it from ``RUN_DIR/.hpc_ddp-secret``: one open
of the shared filesystem per rank at every attempt's start, which B14 counts in a failure's row and
which grows with the ranks per node. A launcher that starts a step's ranks (the batch shell's srun,
the local rehearsal) reads it once and hands it down in :data:`SECRET_VAR`; a rank started any other
way (your own srun line, a container that cleans the environment) reads the file as before.

The value is bound to the run dir's path (``TAG:HEX``, TAG a digest of the absolute path), so a
variable meant for one run is never taken for another run's secret by a process of a sweep or a
chained job that inherited it. A process's environment is readable only by its own user (and root),
as the secret file is. A rank takes the variable out of its environment as it starts (:func:`take`),
before any code of yours runs, so what your code starts (data loader workers, subprocesses) does not
inherit it and a loop that logs its environment (to W&B, to a shared log) does not publish it. No
torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, MutableMapping
from pathlib import Path

SECRET_VAR = "HPC_DDP_RUN_SECRET"
_taken: str | None = None  # what :func:`take` took out of this process's environment


def take(environ: MutableMapping[str, str]) -> None:
    """At a rank's start: the handed secret out of ``environ`` (this process's: its children and
    your code never see it), kept in this process for :func:`handed`."""
    global _taken
    value = environ.pop(SECRET_VAR, None)
    if value is not None:
        _taken = value


def bound_to(run_dir: Path | str) -> str:
    """The tag that binds a handed secret to one run dir: a digest of its absolute path."""
    return hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:16]


def entry(run_dir: Path | str, secret: bytes) -> dict[str, str]:
    """What a launcher adds to its ranks' environment for ``run_dir``."""
    return {SECRET_VAR: f"{bound_to(run_dir)}:{secret.hex()}"}


def handed(run_dir: Path | str, environ: Mapping[str, str], size: int) -> bytes | None:
    """The secret of ``run_dir`` this process was handed (``size`` bytes: what :func:`take` took,
    else ``environ``'s), or None: absent, meant for another run dir, or not ``2 * size`` hex digits
    (the file is read then)."""
    tag, _, digits = (_taken if _taken is not None else environ.get(SECRET_VAR, "")).partition(":")
    if tag != bound_to(run_dir) or len(digits) != 2 * size:
        return None
    try:
        return bytes.fromhex(digits)
    except ValueError:
        return None
