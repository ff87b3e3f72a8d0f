#!/usr/bin/env bash
# The whole test suite, real Slurm included, from nothing: installs Debian's Slurm
# packages and the Python environment (dev/setup.sh --slurm), then runs pytest.
# The session fixture starts the local multi-node cluster (as root) and stops it after.
# HPC_DDP_REQUIRE_SLURM=1 turns "Slurm missing" skips into failures: CI must run them.
#
# Extra arguments go to pytest, e.g. `bash dev/test.sh -k hostlist` or
# `bash dev/test.sh -m "not cluster"` (a developer's loop without the cluster; its tests run last).
#
# With no arguments it runs two pytest sessions side by side: the cluster's tests (tests/cluster:
# they mostly wait, for a job to start, a liveness or watchdog timeout, slurmctld; 41% of 2 cores
# alone) and the rest (CPU-bound rehearsals), niced (HPC_DDP_TEST_REST_NICE, default 10) so that the
# cluster's timing-bound jobs get the CPU when they need it and the rest fills the time they idle.
# Measured 2026-12-02 on 2 cores: 25-26 min side by side, both green (three runs, two of them fresh
# clones), against 41 min in one session (cluster 18.8 + rest 20.0); 2026-12-03, a fresh clone: the
# rest 24:09, the cluster's 25:15; later that day, on a slower machine (3,280 CPU-s busy, 90%), the
# rest 30:18, the cluster's 29:12. Both are bound by the machine's CPU (dev/pytest_cpu.py gives each
# test's CPU, its processes' included); dev/machine_cpu.py prints, at the end, the machine's CPU
# use and the run in units of a reference `import torch` measured at the start. The cluster's session writes
# .pytest-cluster.log, printed whole when both are done; the exit code is non-zero if either
# failed. HPC_DDP_TEST_SIDE_BY_SIDE=0 runs everything in one session (the cluster's tests last).
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh --slurm
export HPC_DDP_REQUIRE_SLURM="${HPC_DDP_REQUIRE_SLURM:-1}"
python="${HPC_DDP_VENV:-.venv}/bin/python"
# Bytecode once, before the tests: every rank process imports ~150 of the package's modules, and
# where PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines) each process would
# compile them again from source (~0.1 s of CPU a process, a few thousand processes a run).
"$python" -m compileall -q hpc_ddp tests benchmarks >/dev/null
if [ "$#" -gt 0 ] || [ "${HPC_DDP_TEST_SIDE_BY_SIDE:-1}" != 1 ]; then
    exec "$python" -m pytest "$@"
fi

log=.pytest-cluster.log
# the machine's speed today (a reference import) and its CPU counters, read back at the end
"$python" dev/machine_cpu.py start .machine-cpu.json || true
start=$SECONDS
# -p no:cacheprovider: one session writes pytest's cache (the last-failed list), not both at once
"$python" -m pytest tests/cluster -m cluster -p no:cacheprovider >"$log" 2>&1 &
cluster=$!
trap 'kill "$cluster" 2>/dev/null || true' INT TERM
rest=0
nice -n "${HPC_DDP_TEST_REST_NICE:-10}" "$python" -m pytest --ignore=tests/cluster -m "not cluster" || rest=$?
echo "== the rest is done after $((SECONDS - start)) s; waiting for the cluster's tests (log: $log)"
on_cluster=0
wait "$cluster" || on_cluster=$?
echo "== the cluster's tests (-m cluster), run beside the rest: exit $on_cluster"
cat "$log"
echo "== both sessions done in $((SECONDS - start)) s: the rest exit $rest, the cluster's tests exit $on_cluster"
"$python" dev/machine_cpu.py end .machine-cpu.json || true
[ "$rest" = 0 ] && [ "$on_cluster" = 0 ]
