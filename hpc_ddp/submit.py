"""``python -m hpc_ddp.submit CONFIG.yaml key=value ...`` (and ``hpc-ddp-submit``): submit a run
from the login node.

An entry point at a path that never moves: Slurm keeps batch scripts that name it, and users
type it. The code is in :mod:`hpc_ddp.login.submit`.
"""

from __future__ import annotations

import sys

from hpc_ddp.login.submit import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
