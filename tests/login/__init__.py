"""Tests of the login node: submit, status, preflight, sbatch (never torch)."""
