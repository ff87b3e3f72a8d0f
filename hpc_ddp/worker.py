"""``python -m hpc_ddp.worker`` (and ``hpc-ddp-worker``): one task of a run; and submitit's job
callable.

An entry point at a path that never moves. submitit pickles :func:`job_main` by its module path
(``hpc_ddp.worker.job_main``), and Slurm keeps batch scripts that run ``-m hpc_ddp.worker``:
a job submitted before an upgrade must still find both after it. So they live here, import
nothing at load, and hand over to :mod:`hpc_ddp.rank.worker`.
"""

from __future__ import annotations

from typing import Any

EARLY_FLAG = None
# first, before omegaconf or torch load: a stop signal at start-up is recorded
if __name__ == "__main__":
    from hpc_ddp.core.stopping import EARLY_SIGNALS, StopFlag  # stdlib only

    EARLY_FLAG = StopFlag()
    EARLY_FLAG.install(EARLY_SIGNALS)

__all__ = ["console_main", "job_main", "main"]


def main(argv: list[str] | None = None) -> int:
    """One task's attempt; its exit code (see :func:`hpc_ddp.rank.worker.main`)."""
    from hpc_ddp.rank.worker import main as run_task

    return run_task(argv, early=EARLY_FLAG)


def job_main(config_path: str) -> None:
    """The callable submitit runs in every task (pickled by reference: importing it is light).

    It runs the same attempt as ``python -m hpc_ddp.worker`` and leaves with the same
    exit code. Our signal handlers, installed inside, replace submitit's, so exactly one
    requeue happens per stop (ours, from rank 0).
    """
    from hpc_ddp.core.shutdown import exit_fast

    exit_fast(main(["--config", config_path]))


def console_main() -> None:
    """The ``hpc-ddp-worker`` console script: like ``python -m hpc_ddp.worker``."""
    # snapshots, ledger and DONE.json are fsynced by now
    from hpc_ddp.core.shutdown import exit_fast

    exit_fast(main())


def __getattr__(name: str) -> Any:
    """``hpc_ddp.worker.session`` and the rest of the task's code, from
    :mod:`hpc_ddp.rank.worker`."""
    import importlib

    return getattr(importlib.import_module("hpc_ddp.rank.worker"), name)


if __name__ == "__main__":
    console_main()
