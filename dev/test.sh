#!/usr/bin/env bash
# The whole test suite, real Slurm included, from nothing: installs Debian's Slurm
# packages and the Python environment (dev/setup.sh --slurm), then runs pytest.
# The session fixture starts the local multi-node cluster (as root) and stops it after.
# HPC_DDP_REQUIRE_SLURM=1 turns "Slurm missing" skips into failures: CI must run them.
# Extra arguments go to pytest, e.g. `bash dev/test.sh -k hostlist`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh --slurm
export HPC_DDP_REQUIRE_SLURM="${HPC_DDP_REQUIRE_SLURM:-1}"
exec "${HPC_DDP_VENV:-.venv}/bin/python" -m pytest "$@"
