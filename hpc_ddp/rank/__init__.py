"""rank: what runs in every task (``python -m hpc_ddp.worker``): one process per GPU, owning the
process group.

One folder per job, each importing only the folders below it (docs/layout.md; checked by
.importlinter): ``worker.py`` (the front door), ``script/`` (wrapped scripts), ``attempt/`` (the
session: opens and closes an attempt), ``loop/`` (the run API, Trainer, Task, sampler), ``salvage/``
(what the survivors save after a failure), ``state/`` (snapshots of state), ``watch/`` | ``group/``
| ``metrics/`` (noticing a failure, process groups, metrics), ``stop/`` (a stop signal's rank side).
Imports core, rundir and torch; never the login node's code, the batch shell's or the rehearsal's.
"""
