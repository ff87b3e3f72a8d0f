"""A sick node kept out on the real local cluster of machines (issue 60, ``slurm.health``): a node whose CPU is
capped fails the health check before the first step, and the spare takes its place, losing no step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core.hostlist import expand_hostlist
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import finished, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm]


def test_a_node_capped_to_a_tenth_of_a_core_fails_the_health_check_and_the_spare_takes_its_place(
        node_faults: ClusterSpec, tmp_path: Path) -> None:
    """2 nodes x 1 task with a spare (the batch shell's n1), checks quick: n3's machine capped at 5 % of this
    machine from before the job starts. The check names n3 (its matmul far below n2's), every rank stops at the
    first boundary (`slow`, replace n3), and the job goes on on n1 and n2 from that snapshot; status says why."""
    from hpc_ddp.slurm_local import faults

    faults.fault(node_faults, "n3", "slow=0.05")
    run_dir = tmp_path / "sick"
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "slurm.nodes=2",
                           "slurm.tasks_per_node=1", "slurm.spare_nodes=1", "slurm.health.checks=quick",
                           "train.max_steps=30", "snapshot.every_steps=null",
                           f"run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = lambda: subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(run_dir)],  # noqa: E731
                                    capture_output=True, text=True).stdout
    assert wait_until(lambda: finished(run_dir), 300), status()
    attempts = read_attempts(run_dir)
    assert [a["reason"] for a in attempts] == ["slow", "finished"], attempts
    first, healed = attempts
    assert first["hosts"] == "n[2-3]" and first["replace"] == ["n3"], first
    assert list(first["health"]["sick"]) == ["n3"] and "a matmul at" in first["health"]["sick"]["n3"], first
    assert healed["healed"]["how"] == "replaced" and list(healed["healed"]["excluded"]) == ["n3"], healed
    assert "failed its health check" in healed["healed"]["excluded"]["n3"]
    assert "n3" not in expand_hostlist(healed["hosts"]) and healed["health"]["sick"] == {}
    assert healed["resumed_from"] == first["last_step"] >= 1  # the stop's snapshot: nothing lost
    assert json.loads((run_dir / "DONE.json").read_text())["step"] == 30
    said = status()
    assert "#0: health check (quick, " in said and "sick: n3: " in said, said
    assert "left out n3: failed its health check (" in said, said
