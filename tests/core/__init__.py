"""Tests of hpc_ddp.core: pure code that runs anywhere."""
