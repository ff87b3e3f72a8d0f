#!/usr/bin/env bash
# The main job on the local default, from nothing: installs what it runs (dev/setup.sh with
# torch, submitit and omegaconf; not the test and docs tools dev/test.sh installs), then trains the small character-level GPT of examples/char_gpt.yaml as
# a 2-node x 2-task Slurm job rehearsed on this machine: 4 gloo processes with the Slurm
# variables srun would give them, the same worker code as on a cluster. Rank 0's
# progress is shown; the loss falls from ~2.45 (step 50) to ~1.6 (step 500) in under a minute on 2 cores.
# Extra arguments are overrides, e.g. `bash dev/demo.sh train.max_steps=300 slurm.nodes=1`.
set -euo pipefail
cd "$(dirname "$0")/.."
HPC_DDP_EXTRAS="${HPC_DDP_EXTRAS-}" bash dev/setup.sh
exec "${HPC_DDP_VENV:-.venv}/bin/python" -m hpc_ddp.submit examples/char_gpt.yaml --local "$@"
