"""``python -m hpc_ddp.status RUN_DIR`` (and ``hpc-ddp-status``): what a run did, attempt by
attempt.

An entry point at a path that never moves: Slurm keeps batch scripts that name it, and users
type it. The code is in :mod:`hpc_ddp.login.status.cli`.
"""

from __future__ import annotations

import sys

from hpc_ddp.login.status.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
