"""Issue 57, a tidy run dir: after a run at 2x2 with a hang and two heals, jit/ holds whole only the last
attempt's folder (each earlier one its commit claim, the fence, and the offers a kept survivors' snapshot of its
is checked against), and errors/ one flight-recorder file per node for the hang, not one per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.rundir import flight
from hpc_ddp.rundir.ledger import read_attempts

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_a_hang_and_two_heals_leave_one_whole_jit_folder_and_one_flight_file_per_node(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--local",
                           f"run_dir={run_dir}", "slurm.nodes=2", "slurm.tasks_per_node=2", "slurm.spare_nodes=1",
                           "train.task=tests.tasks:Faulty", "train.max_steps=40", "snapshot.every_steps=10",
                           "train.log_every=1", "dist.timeout_s=4", "--fail-at", "30:0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HPC_DDP_TEST_FAULT": "sleep:1:12"})  # rank 1 hangs in step 12
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a.get("in_job", 0)) for a in attempts] == [("hung", 0), ("failed", 1), ("finished", 2)]
    folders = sorted((run_dir / "jit").iterdir(), key=lambda p: (len(p.name), p.name))
    assert [f.name.removeprefix(folders[0].name) for f in folders] == ["", "-step-1", "-step-2"]
    # the hang's attempt: its survivors' snapshot (step 11) is no longer kept, so only the fence stays
    assert [p.name for p in folders[0].iterdir()] == ["commit"]
    # the killed node's attempt: its survivors' snapshot (step 30) is the newest, so its offers stay too
    assert sorted(p.name for p in folders[1].iterdir()) == ["commit", "node-0.json", "node-1.json"]
    assert (folders[2] / "stopped-mid-step").exists()  # the last attempt's folder is whole
    flights = sorted(p.name for p in (run_dir / "errors").iterdir() if "-collectives-" in p.name)
    assert flights == [f"{folders[0].name}-collectives-node-0.json", f"{folders[0].name}-collectives-node-1.json"]
    assert sorted(flight.read(str(run_dir / attempts[0]["collectives"]))) == [0, 1, 2, 3]
