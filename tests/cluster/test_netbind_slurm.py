"""On the real local cluster (issue 46): every rank's CPU view is in the job's log, one line per node; the local
cluster's node names resolve to their own addresses, so nothing changes; a rank that srun binds below slurm.cpus_per_task is refused.

The two jobs run side by side (2 nodes x 2 tasks x 1 CPU, and 1 node x 1 task x 2 CPUs fit the 3 nodes of 4
declared CPUs together). The cluster's slurmd binds no task (TaskPlugin=task/none), so the refused job narrows its
one task to CPU 0 through the fault-injection variable (hpc_ddp.rank.attempt.placement.FAULT_CPUS_VAR), a real
sched_setaffinity before the check, standing in for what `srun` without --cpus-per-task gives on Slurm 22.05.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import finished, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slurm


def _submit(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note [slurm.cpus_per_task]: Slurm 22.05: srun does not inherit --cpus-per-task" in proc.stderr
    return proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]


def _logs(run_dir: Path) -> str:
    return "".join(path.read_text(errors="replace") for path in sorted((run_dir / "slurm").glob("*_log.err")))


def test_each_node_logs_its_ranks_binding_and_a_rank_bound_below_cpus_per_task_is_refused(
        slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    good, bound = tmp_path / "good", tmp_path / "bound"
    _submit("slurm.nodes=2", "slurm.tasks_per_node=2", "slurm.cpus_per_task=1", "train.max_steps=3",
            f"run_dir={good}")
    _submit("slurm.nodes=1", "slurm.tasks_per_node=1", "slurm.cpus_per_task=2", "train.max_steps=3",
            "slurm.setup=[export HPC_DDP_FAULT_CPUS=0]", f"run_dir={bound}")
    assert wait_until(lambda: finished(good), 240), _logs(good)[-3000:]
    lines = [line for line in _logs(good).splitlines() if "hpc_ddp.placement: binding on" in line]
    assert len(lines) == 2, lines  # one per node, not one per rank
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        [line] = [line for line in lines if f"(node {node} of 2)" in line]
        assert all(f"rank {rank} (local {rank % 2}): CPUs " in line for rank in ranks), line
    # n1 resolves to its own address (10.77.0.1 on the cluster of machines, 127.0.2.1 on one machine): gloo finds
    # the right interface by the hostname, and no SOCKET_IFNAME is set
    assert "SOCKET_IFNAME" not in _logs(good)

    assert wait_until(lambda: any(a.get("reason") == "error" for a in read_attempts(bound)), 240), _logs(bound)
    [attempt] = read_attempts(bound)
    assert attempt["message"].startswith("rank 0 (local rank 0) on n") and attempt["exit_code"] == 2
    message = (bound / "errors" / f"job-{attempt['job_id']}-restart-0.txt").read_text()  # the whole message
    for words in ("may run on 1 CPU(s)", "slurm.cpus_per_task=2", "SLURM_CPUS_PER_TASK=2",
                  "srun --cpus-per-task=2", "SRUN_CPUS_PER_TASK=2", "Slurm 22.05"):
        assert words in message, message
    assert not (bound / "DONE.json").exists() and not list((bound / "snapshots").glob("step-*"))
