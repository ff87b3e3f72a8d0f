"""An admin's ``scontrol requeue`` of a running job, on the real cluster (the trial's job 58): Slurm requeues the
job itself (Restarts goes up), so rank 0 must record it as ``requeued`` by Slurm and neither requeue it again nor
log "`scontrol requeue` failed: Job is pending execution" with a hint to resubmit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import finished, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SCRIPT = """import os, time
base = 100 * int(os.environ.get("HPC_DDP_RESTART_COUNT", "0"))
for epoch in range(1, 9):
    print(f"Epoch {base + epoch}", flush=True)
    time.sleep(1)
"""


def test_an_admins_scontrol_requeue_is_recorded_as_slurms_requeue_and_the_run_finishes(slurm_cluster: ClusterSpec,
                                                                                       tmp_path: Path) -> None:
    script, run_dir = tmp_path / "train.py", tmp_path / "run"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "name=requeued_by_admin",
                           f"train.script={script}", "train.script_progress=Epoch (\\d+)", "slurm.nodes=1",
                           "slurm.tasks_per_node=1", "slurm.timeout_min=10", f"run_dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]
    out = lambda: "".join(p.read_text(errors="replace") for p in (run_dir / "slurm").glob("*_log.*"))  # noqa: E731
    assert wait_until(lambda: (run_dir / "slurm").is_dir() and "Epoch 3" in out(), 600), out()[-3000:]
    subprocess.run(["scontrol", "requeue", job], check=True)  # what an admin does
    assert wait_until(lambda: finished(run_dir), 240), (read_attempts(run_dir), out()[-3000:])
    attempts = read_attempts(run_dir)
    assert [a["reason"] for a in attempts] == ["requeued", "finished"], attempts
    assert attempts[0]["requeue_by"] == "slurm" and int(attempts[0]["slurm"]["Restarts"]) == 1, attempts
    logs = out()
    assert "pending execution" not in logs and "JobRequeue" not in logs and " ERROR " not in logs, logs[-3000:]
