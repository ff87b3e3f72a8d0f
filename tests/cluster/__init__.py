"""Tests on the real local Slurm cluster (nodes as machines): marked slurm and cluster."""
