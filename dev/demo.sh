#!/usr/bin/env bash
# The main job on the local default, from nothing: installs the Python environment
# (dev/setup.sh), then shows what every rank of a simulated 2-node x 2-task Slurm job
# derives (rank, local rank, node, rendezvous address and port) from the same code the
# workers run. Pass another shape as NODESxTASKS: `bash dev/demo.sh 4x8`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
exec "${HPC_DDP_VENV:-.venv}/bin/python" -m hpc_ddp.whoami --simulate "${1:-2x2}"
