#!/usr/bin/env bash
# The main job on the local default, from nothing: installs the Python environment
# (dev/setup.sh), then rehearses examples/mlp.yaml as a 2-node x 2-task Slurm job on
# this machine: 4 gloo processes with the Slurm variables srun would give them, the
# same worker code as on a cluster; rank 0's progress is shown and the loss falls.
# Extra arguments are overrides, e.g. `bash dev/demo.sh train.max_steps=300 slurm.nodes=1`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
exec "${HPC_DDP_VENV:-.venv}/bin/python" -m hpc_ddp.submit examples/mlp.yaml --local "$@"
