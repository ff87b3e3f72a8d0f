"""A heal's timeline on the real local cluster: the batch shell's times (detected, launched) reach the healed
step's rank 0 through srun, which writes them with its own into its ledger line; ``status`` shows them. One
small job on one node (no spare to wait for: the killed rank's node is tried once more), a few steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core import timeline as tl
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import finished, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slurm


def test_a_heal_on_slurm_times_every_phase_from_the_shell_and_rank_0(slurm_cluster: ClusterSpec,
                                                                     tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml",
                           "train.task=tests.tasks:Faulty", "slurm.nodes=1", "slurm.tasks_per_node=2",
                           "train.max_steps=16", "snapshot.every_steps=5", "train.log_every=5",
                           "train.global_batch_size=64", f"run_dir={run_dir}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HPC_DDP_TEST_FAULT": "kill:1:8"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = lambda: subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(run_dir)],  # noqa: E731
                                    cwd=tmp_path, capture_output=True, text=True, timeout=120,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert wait_until(lambda: finished(run_dir), 240), status()
    failed, healed = read_attempts(run_dir)
    assert (failed["reason"], healed["in_job"], healed["healed"]["how"]) == ("failed", 1, "retried")
    timeline = healed["timeline"]
    assert timeline["kind"] == "heal" and [p for p in tl.PHASES if p in timeline] == [
        "detected", "launched", "started", "imported", "group_ready", "restored", "first_step"], timeline
    assert tl.out_of_order(timeline) == [] and timeline["detected"] >= 0, timeline  # one machine: one clock
    shown = status()
    assert "timeline of attempt #1 (heal), seconds after the failure" in shown, shown
    assert all(f"  {phase} " in shown for phase in ("detected", "launched", "first_step")), shown
