"""Tests of hpc_ddp.rundir: the files of the run directory."""
