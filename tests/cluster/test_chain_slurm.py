"""Issue 46 (5) on the real cluster: a job Slurm may not requeue goes on as a chain of jobs, one run.

Submitted with ``--no-requeue`` (``slurm.sbatch_extra: {no-requeue: ""}``), the job's ``scontrol requeue``
is refused ("Requested operation is presently disabled") and Slurm cancels it when it is preempted
(PreemptMode=REQUEUE cancels a job that may not be requeued). So at each stop the batch shell submits the
run's next job with ``--dependency=afterany``; the ledger names it, and status lists the jobs as one run. At the
second preemption the batch shell gets a SIGTERM too, as on a cluster that preempts with SIGTERM: it must
still outlive the step and chain (submitit's bash would end before its teardown line without a trap)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import finished, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# one whole node (so the preempting job takes this job's node and no other job's), 2 ranks, 0.05 s a step
ARGS = ["examples/mlp.yaml", "train.task=tests.tasks:Faulty", "slurm.nodes=1", "slurm.tasks_per_node=2",
        "slurm.exclusive=true", "train.max_steps=240", "train.log_every=1", "slurm.timeout_min=30",
        "slurm.sbatch_extra.no-requeue=''"]
FAULT = {"HPC_DDP_TEST_FAULT": "slow:-1:0.05"}  # the fixture sets SLURM_CONF: the environment is read in the test


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def squeue(job: str, fmt: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", fmt], capture_output=True, text=True).stdout.strip()


def logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace")[-2500:] for p in sorted((run_dir / "slurm").glob("*_log.err")))


def test_a_job_slurm_may_not_requeue_is_preempted_twice_and_finishes_bit_exact_through_a_chain_of_three_jobs(
        slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    run_dir, env = tmp_path / "chain", {**os.environ, **FAULT}
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *ARGS, f"run_dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after a stop: chain" in proc.stderr, proc.stderr  # preflight says which path this cluster takes
    jobs = [proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]]
    local = subprocess.Popen([sys.executable, "-m", "hpc_ddp.submit", *ARGS, "--local",
                              f"run_dir={tmp_path / 'local'}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=env)  # the uninterrupted run beside it
    try:
        for stop in range(2):
            job, since = jobs[-1], last_step(run_dir)
            assert wait_until(lambda: squeue(job, "%T") == "RUNNING" and last_step(run_dir) >= since + 25, 600), (
                jobs, read_attempts(run_dir), logs(run_dir))
            node = squeue(job, "%N")
            subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", node, "-N1", "--exclusive",
                            "--output=/dev/null", "--wrap", "sleep 1"], check=True, capture_output=True)
            if stop:  # as a cluster that preempts with SIGTERM does, the batch shell gets one too: it still chains
                subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True, capture_output=True)
            line = lambda: next((a for a in read_attempts(run_dir) if str(a.get("job_id")) == job), {})  # noqa: E731
            assert wait_until(lambda: line().get("next_job"), 300), (read_attempts(run_dir), logs(run_dir))
            jobs.append(str(line()["next_job"]))
        assert wait_until(lambda: finished(run_dir), 600), (jobs, read_attempts(run_dir), logs(run_dir))
    finally:
        _, err = local.communicate(timeout=600)
    assert local.returncode == 0, err[-3000:]
    attempts = read_attempts(run_dir)
    assert [(a["reason"], str(a["job_id"]), a["restart_count"]) for a in attempts] == [
        ("preemption", jobs[0], 0), ("preemption", jobs[1], 0), ("finished", jobs[2], 0)], attempts
    for before, after, nxt in zip(attempts, attempts[1:], jobs[1:]):
        assert "presently disabled" in before["requeue_refused"] and before["next_job"] == nxt, before
        assert after["chained_from"] == int(before["job_id"]) and after["resumed_from"] == before["last_step"], after
    assert json.loads((run_dir / "DONE.json").read_text())["params_sha256"] == json.loads(
        (tmp_path / "local" / "DONE.json").read_text())["params_sha256"]
    assert "hpc_ddp: the batch shell got SIGTERM" in (run_dir / "slurm" / f"{jobs[1]}_0_log.err").read_text()
    status = subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(run_dir)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert f"jobs    {' -> '.join(jobs)}  (a chain" in status.stdout, status.stdout
