"""Tests of hpc_ddp.rank: what every rank runs (real gloo groups on the CPU)."""
