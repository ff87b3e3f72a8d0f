"""``python -m hpc_ddp.supervise CONFIG -- srun ...``: the batch shell's supervisor (sbatch scripts
call it).

An entry point at a path that never moves: Slurm keeps batch scripts that name it, and users
type it. The code is in :mod:`hpc_ddp.shell.supervise`.
"""

from __future__ import annotations

import sys

from hpc_ddp.shell.supervise import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
