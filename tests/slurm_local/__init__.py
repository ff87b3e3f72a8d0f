"""Tests of hpc_ddp.slurm_local: the throw-away cluster, its pure parts."""
