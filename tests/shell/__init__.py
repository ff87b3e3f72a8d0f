"""Tests of the batch shell: supervise, settle, heal (pure, through fakes of Slurm)."""
