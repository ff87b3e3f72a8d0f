"""rank: what runs in every task (``python -m hpc_ddp.worker``): one process per GPU, owning the process group.

The worker and session (an attempt: lock, process group, stop flag, watchdog, ledger line),
the run API and Trainer, sampler, distributed and control groups, snapshots of state
(checkpointer, tracked, spread, replication, ddp_settle), liveness and the hang watchdog,
metric sinks, and wrapped scripts. Imports core, rundir and torch; never the login node's code,
the batch shell's or the rehearsal's.
"""
