#!/usr/bin/env bash
# The whole test suite, real Slurm included, from nothing: installs Debian's Slurm
# packages and the Python environment (dev/setup.sh --slurm), then runs pytest.
# The session fixture starts the local multi-node cluster (as root) and stops it after.
# HPC_DDP_REQUIRE_SLURM=1 turns "Slurm missing" skips into failures: CI must run them.
#
# With no arguments the suite runs as two pytest sessions side by side: the cluster's tests
# (tests/cluster, every test marked cluster: they mostly wait, for a job to start, a liveness or
# watchdog timeout, slurmctld) and the rest, so that the rest does not wait behind the cluster. The
# cluster's session writes to .pytest-cluster.log, printed whole when both are done; the exit
# code is non-zero if either failed. HPC_DDP_TEST_SIDE_BY_SIDE=0 runs one session instead.
# Extra arguments go to one pytest session, e.g. `bash dev/test.sh -k hostlist` or
# `bash dev/test.sh -m "not cluster"` (a developer's loop without the cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh --slurm
export HPC_DDP_REQUIRE_SLURM="${HPC_DDP_REQUIRE_SLURM:-1}"
python="${HPC_DDP_VENV:-.venv}/bin/python"
if [ "$#" -gt 0 ] || [ "${HPC_DDP_TEST_SIDE_BY_SIDE:-1}" = 0 ]; then
    exec "$python" -m pytest "$@"
fi

log=.pytest-cluster.log
start=$SECONDS
# -p no:cacheprovider: one session writes pytest's cache (the last-failed list), not both at once
"$python" -m pytest tests/cluster -m cluster -p no:cacheprovider >"$log" 2>&1 &
cluster=$!
trap 'kill "$cluster" 2>/dev/null || true' INT TERM
rest=0
"$python" -m pytest --ignore=tests/cluster -m "not cluster" || rest=$?
echo "== the rest is done after $((SECONDS - start)) s; waiting for the cluster's tests (log: $log)"
on_cluster=0
wait "$cluster" || on_cluster=$?
echo "== the cluster's tests (-m cluster), run beside the rest: exit $on_cluster"
cat "$log"
echo "== both sessions done in $((SECONDS - start)) s: the rest exit $rest, the cluster's tests exit $on_cluster"
[ "$rest" = 0 ] && [ "$on_cluster" = 0 ]
