"""core: pure pieces every place uses. Runs anywhere; imports only the standard library and
omegaconf.

The config (the folder :mod:`hpc_ddp.core.config`: its schema, loading, writing and checks),
the errors, host lists, the Slurm variables (rank, world, address, port), batch sizes, stop
signals, the Slurm commands a job asks about itself, the optional extras, and one table of every
exit code and marker (:mod:`hpc_ddp.core.codes`). Never torch, never another place of hpc_ddp.
"""
