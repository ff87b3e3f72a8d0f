"""Derivation inside real Slurm tasks on the local multi-node cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hpc_ddp.slurm_local import ClusterSpec
from hpc_ddp.core.slurm_env import master_port
from tests.helpers import MLP_300, finished, wait_until

if TYPE_CHECKING:
    from tests.cluster.conftest import Rehearsal

pytestmark = pytest.mark.slurm


def test_every_task_of_srun_2x2_derives_its_place(slurm_cluster: ClusterSpec) -> None:
    proc = subprocess.run(["srun", "-N2", "--ntasks-per-node=2", sys.executable, "-m", "hpc_ddp.whoami", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tasks = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda t: t["rank"])
    assert [t["rank"] for t in tasks] == [0, 1, 2, 3]
    assert [t["local_rank"] for t in tasks] == [0, 1, 0, 1]
    assert [t["node_rank"] for t in tasks] == [0, 0, 1, 1]
    first, second = tasks[0]["node"], tasks[2]["node"]  # two of the cluster's three nodes: whichever are free
    assert [t["node"] for t in tasks] == [first, first, second, second] and first < second
    assert {(t["world_size"], t["local_world_size"], t["num_nodes"], t["source"]) for t in tasks} == {
        (4, 2, 2, "slurm")}
    job_id = tasks[0]["job_id"]
    assert {(t["master_addr"], t["master_port"], t["job_id"]) for t in tasks} == {(first, master_port(job_id),
                                                                                  job_id)}
    # the first node's own address, everywhere: on the local cluster of machines nK is 10.77.0.K, never loopback
    addrs = dict(zip(slurm_cluster.node_names, slurm_cluster.node_addrs))
    assert {t["master_addr_resolved"] for t in tasks} == {addrs[first]}
    assert "network" not in slurm_cluster.isolated or not addrs[first].startswith("127.")


def test_uneven_layout(slurm_cluster: ClusterSpec) -> None:
    proc = subprocess.run(["srun", "-N2", "-n3", sys.executable, "-m", "hpc_ddp.whoami", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tasks = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda t: t["rank"])
    assert [(t["node_rank"], t["local_rank"], t["local_world_size"]) for t in tasks] == [(0, 0, 2), (0, 1, 2),
                                                                                        (1, 0, 1)]


def test_batch_script_without_srun_is_told_to_use_srun(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n{sys.executable} -m hpc_ddp.whoami\necho exit=$?\n")
    proc = subprocess.run(["sbatch", "--wait", "-N2", "--ntasks-per-node=2", f"--output={out}", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "not in a task launched by srun" in text and "HINT: run every task through srun" in text
    assert "exit=1" in text


def test_accounting_answers_for_finished_jobs(slurm_cluster: ClusterSpec) -> None:
    proc = subprocess.run(["sbatch", "--parsable", "--wait", "--wrap", "true", "--output=/dev/null"],
                          capture_output=True, text=True, timeout=120)
    job = proc.stdout.strip().split(";")[0]
    assert wait_until(lambda: "COMPLETED" in subprocess.run(["sacct", "-n", "-X", "-j", job, "-o", "State"],
                                                            capture_output=True, text=True).stdout, 30)  # submitit polls sacct: without it, dead jobs are never noticed


def test_worker_trains_across_two_slurm_nodes_with_gloo(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    _, run_dir = worker_job(tmp_path, "mlp", ["train.max_steps=30", "train.log_every=10"])
    config = run_dir / "config.yaml"
    proc = subprocess.run(["srun", "-N2", "--ntasks-per-node=2", "--kill-on-bad-exit=1", f"--chdir={root}",
                           sys.executable, "-m", "hpc_ddp.worker", "--config", str(config)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads((tmp_path / "mlp" / "DONE.json").read_text())
    assert (done["step"], done["world_size"]) == (30, 4)
    steps = [json.loads(line)["step"] for line in (tmp_path / "mlp" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [10, 20, 30]
    assert "[rank 0]" in proc.stderr and "done: step 30" in proc.stderr


ROOT = Path(__file__).resolve().parents[2]


def worker_job(tmp_path: Path, name: str, overrides: list[str]) -> tuple[Path, Path]:
    """The MLP example's resolved config and a batch script that sruns the worker on it."""
    from hpc_ddp.core.config import load_config, save_config

    run_dir = tmp_path / name
    cfg = load_config([ROOT / "examples" / "mlp.yaml"], [*overrides, f"run_dir={run_dir}"])
    config = save_config(cfg, run_dir / "config.yaml")
    script = tmp_path / f"{name}.sh"
    script.write_text(f"#!/bin/bash\ncd {ROOT}\nexec srun --kill-on-bad-exit=1 {sys.executable} -m hpc_ddp.worker "
                      f"--config {config}\n")
    return script, run_dir


def sbatch(*args: str, env: dict[str, str] | None = None) -> str:
    """Submit; the job's tasks get this process's environment plus ``env`` (sbatch's default --export=ALL)."""
    return subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True,
                          env={**os.environ, **(env or {})}).stdout.strip()


def logged_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def wait_finished(run_dir: Path, out: Path, timeout: float) -> None:
    assert wait_until(lambda: finished(run_dir), timeout), out.read_text()[-3000:]


@pytest.mark.slow
def test_warning_signals_by_scancel_and_by_the_time_limit_snapshot_requeue_and_resume(
        slurm_cluster: ClusterSpec, tmp_path: Path, mlp_300_reference: Callable[[], Rehearsal]) -> None:
    """Two jobs side by side (2 nodes x 2 tasks each), and the rehearsal on this machine while they run:
    (1) scancel --signal=USR2 near the (2-minute) limit: time-out -> snapshot -> scontrol requeue -> resume,
    bit-exact to the rehearsal; (2) --time=1 with USR2@50: Slurm's own warning (at its 30 s tick) -> snapshot
    -> requeue, until finished."""
    from hpc_ddp.rundir.ledger import read_attempts

    # (2) each step sleeps 100 ms (the Faulty task's slow fault): 300 steps take 30 s or more on any machine,
    # longer than the first warning tick (10-26 s after the start), so at least one time-out comes, with little
    # compute
    limited, limited_dir = worker_job(tmp_path, "t", ["train.task=tests.tasks:Faulty", "train.max_steps=300",
                                                      "train.log_every=30", "slurm.timeout_min=1",
                                                      "slurm.signal_delay_s=50"])
    sbatch("-N2", "--ntasks-per-node=2", "--time=1", "--signal=USR2@50", "--requeue", "--open-mode=append",
           f"--output={tmp_path / 't.out'}", str(limited), env={"HPC_DDP_TEST_FAULT": "slow:-1:0.1"})

    overrides = [*MLP_300[1:], "slurm.timeout_min=2", "slurm.signal_delay_s=100"]
    script, run_dir = worker_job(tmp_path, "slurm", overrides)
    job = sbatch("-N2", "--ntasks-per-node=2", "--time=2", "--requeue", "--open-mode=append",
                 f"--output={tmp_path / 'job.out'}", str(script))
    assert wait_until(lambda: len(logged_steps(run_dir)) >= 5, 120)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    local = mlp_300_reference()  # the same training as the job's (its slurm.* options shape only the signals)
    wait_finished(run_dir, tmp_path / "job.out", 180)
    attempts = read_attempts(run_dir)
    assert [a["reason"] for a in attempts] == ["timeout", "finished"]
    assert [a["restart_count"] for a in attempts] == [0, 1] and attempts[1]["resumed_from"] == attempts[0]["last_step"]
    assert logged_steps(run_dir) == list(range(10, 301, 10))  # continuous: nothing twice, nothing skipped
    assert json.loads((run_dir / "DONE.json").read_text())["params_sha256"] == json.loads(
        (local.done() / "DONE.json").read_text())["params_sha256"]  # the rehearsal predicts the cluster

    wait_finished(limited_dir, tmp_path / "t.out", 300)
    reasons = [a["reason"] for a in read_attempts(limited_dir)]
    assert reasons[-1] == "finished" and set(reasons[:-1]) == {"timeout"} and len(reasons) >= 2
    assert logged_steps(limited_dir) == list(range(30, 301, 30))


def test_preemption_by_a_higher_priority_job_snapshots_and_resumes(slurm_cluster: ClusterSpec,
                                                                   tmp_path: Path) -> None:
    """A job in `high` needs both nodes: the `debug` job gets USR2 at once, saves, is requeued, resumes."""
    from hpc_ddp.rundir.ledger import read_attempts

    script, run_dir = worker_job(tmp_path, "p", ["train.max_steps=300", "train.log_every=10",
                                                 "slurm.timeout_min=30"])
    sbatch("-p", "debug", "-N2", "--ntasks-per-node=2", "--time=30", "--requeue", "--open-mode=append",
           f"--output={tmp_path / 'job.out'}", str(script))
    assert wait_until(lambda: len(logged_steps(run_dir)) >= 5, 120)
    sbatch("-p", "high", "-N2", "--exclusive", "--output=/dev/null", "--wrap", "sleep 1")
    wait_finished(run_dir, tmp_path / "job.out", 240)
    attempts = read_attempts(run_dir)
    assert [a["reason"] for a in attempts] == ["preemption", "finished"]
    assert attempts[1]["resumed_from"] == attempts[0]["last_step"]
    assert logged_steps(run_dir) == list(range(10, 301, 10))
