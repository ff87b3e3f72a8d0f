"""``python -m hpc_ddp.profiles list | show NAME`` (and ``hpc-ddp-profiles``): the cluster profiles
a submit merges in.

An entry point at a path that never moves, as ``hpc_ddp.submit`` and ``hpc_ddp.status`` are. The
code is in :mod:`hpc_ddp.login.profiles`; where profiles live and which one a run uses, in
:mod:`hpc_ddp.core.profiles`.
"""

from __future__ import annotations

import sys

from hpc_ddp.login.profiles import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
