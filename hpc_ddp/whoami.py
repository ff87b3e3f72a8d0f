"""``python -m hpc_ddp.whoami`` (and ``hpc-ddp-whoami``): what this task would be (rank, world,
address, port).

An entry point at a path that never moves: Slurm keeps batch scripts that name it, and users
type it. The code is in :mod:`hpc_ddp.core.whoami`.
"""

from __future__ import annotations

import sys

from hpc_ddp.core.whoami import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
