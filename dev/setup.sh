#!/usr/bin/env bash
# Prepare this checkout on a fresh Debian/Ubuntu machine: Python venv in .venv with
# torch==2.13.0 (installed first, so pip does not pull another build) and hpc_ddp[dev].
# With --slurm, also Debian's Slurm, munge and MariaDB packages for the local test cluster.
# Idempotent: what is already there is kept. Override: HPC_DDP_VENV, TORCH_SPEC, and
# HPC_DDP_EXTRAS (default dev; dev/demo.sh sets it empty: torch, submitit and omegaconf only).
set -euo pipefail
cd "$(dirname "$0")/.."

want_slurm=0
[ "${1:-}" = "--slurm" ] && want_slurm=1
venv="${HPC_DDP_VENV:-.venv}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
# bindfs and iproute2: each local node a machine of its own (its cached view of the shared root, its network)
slurm_packages="slurmctld slurmd slurm-client munge slurmdbd mariadb-server bindfs iproute2"

sudo=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null; then sudo="sudo"; else echo "note: not root and no sudo; apt steps will fail" >&2; fi
fi

packages=()
if ! command -v python3 >/dev/null; then
    packages+=(python3 python3-venv python3-dev)
elif ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "error: hpc_ddp needs Python >= 3.10; found $(python3 --version). Install a newer python3." >&2
    exit 1
elif ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    packages+=(python3-venv)  # Debian splits ensurepip out of python3
fi
if ! command -v g++ >/dev/null; then
    packages+=(g++)  # torch.compile's CPU backend (inductor) builds C++ kernels: tests/rank/test_compile.py
fi
if [ "$want_slurm" = 1 ]; then
    for tool in slurmctld slurmd sbatch munged slurmdbd mariadbd bindfs ip; do
        if ! command -v "$tool" >/dev/null && [ ! -x "/usr/sbin/$tool" ]; then
            read -r -a slurm_list <<< "$slurm_packages"
            packages+=("${slurm_list[@]}")
            break
        fi
    done
fi
if [ "${#packages[@]}" -gt 0 ]; then
    echo "installing Debian packages: ${packages[*]}"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${packages[@]}"
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "creating virtual environment $venv"
    python3 -m venv "$venv"
fi
extras="${HPC_DDP_EXTRAS-dev}"
target="."
[ -n "$extras" ] && target=".[$extras]"
echo "installing $torch_spec and hpc_ddp${extras:+[$extras]} into $venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$torch_spec"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$target"
