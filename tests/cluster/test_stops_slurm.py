"""Issue 43 on the real cluster: a stop reaches every process of the step, loader workers included.

Slurm signals every process of a job step. With DataLoader workers, a plain ``scancel`` used to kill the
workers, crash the ranks and leave no ledger line; a preemption by Slurm's default SIGTERM was recorded as a
failure. Each test submits its jobs side by side and idles while Slurm works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.rundir import metrics_file, snapshot
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import assert_kept_the_step, finished, job_gone, wait_until
from tests.wandb_reader import wandb_fragments, wandb_history

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# the newcomer's own loop (BatchNorm, dropout, AdamW, cosine schedule, a DataLoader with two workers), 2 x 1
LOOP = ["examples/own_loop_gpt.yaml", "train.loop=tests.tasks.loops:loader_workers", "slurm.tasks_per_node=1",
        "train.grad_accum=1", "train.log_every=1", "snapshot.every_steps=50", "slurm.timeout_min=30"]
TASK = ["examples/mlp.yaml", "train.num_workers=2", "train.log_every=1", "snapshot.every_steps=50",
        "slurm.timeout_min=30"]


def submit(args: list[str], run_dir: Path, loader: str = "fork", fault: str = "none:-1:-1") -> str:
    """Submit through the CLI with the loop's loader context (and a test fault) in the job's environment; the job
    id."""
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *args, f"run_dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HPC_DDP_TEST_LOADER": loader, "HPC_DDP_TEST_FAULT": fault})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]


def logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace")[-3000:] for p in sorted((run_dir / "slurm").glob("*_log.*")))


def test_scancel_and_a_bare_sigterm_with_loader_workers_are_stops_that_keep_the_work(slurm_cluster: ClusterSpec,
                                                                                     tmp_path: Path) -> None:
    """Five jobs side by side, each stopped mid-run between periodic snapshots (every 50 steps): an own loop
    whose fork workers are not shielded, one with spawn workers shielded by hpc_ddp.worker_init(), and a Task
    (our Trainer's loaders are shielded) get `scancel`: each is `cancelled`, with a ledger line and a snapshot
    of the step it held, not requeued. A bare `scancel --signal=TERM` to an own loop with unshielded spawn
    workers is never a failure: a preemption (the ledger says why), requeued, finished; nor is the warning
    signal, which kills unshielded spawn workers outright."""
    runs = {"fork": (LOOP + ["train.max_steps=2000"], "fork"), "shielded": (LOOP + ["train.max_steps=2000"],
            "spawn:shield"), "task": (TASK + ["train.max_steps=5000"], "fork"),
            "term": (LOOP + ["train.max_steps=60"], "spawn"), "usr2": (LOOP + ["train.max_steps=60"], "spawn")}
    jobs = {name: submit(args, tmp_path / name, loader) for name, (args, loader) in runs.items()}
    sent: dict[str, int] = {}

    def stop_each_once_it_trains() -> bool:
        for name, job in jobs.items():
            if name not in sent and logged(tmp_path / name) >= 20:
                sent[name] = logged(tmp_path / name)
                how = {"term": ["--signal=TERM"], "usr2": ["--signal=USR2"]}.get(name, [])
                subprocess.run(["scancel", *how, job], check=True)
        return len(sent) == len(jobs)
    assert wait_until(stop_each_once_it_trains, 300), {n: logged(tmp_path / n) for n in jobs}
    assert wait_until(lambda: all(job_gone(jobs[n]) for n in ("fork", "shielded", "task")) and finished(
        tmp_path / "term") and finished(tmp_path / "usr2"), 300), {n: read_attempts(tmp_path / n) for n in jobs}
    for name in ("fork", "shielded", "task"):
        attempts = read_attempts(tmp_path / name)
        assert [a["reason"] for a in attempts] == ["cancelled"], (name, attempts, logs(tmp_path / name))
        kept = attempts[0]["last_step"]
        assert kept == snapshot.committed_steps(tmp_path / name)[0] and kept >= sent[name], (name, attempts)
        if name == "fork":  # a broken step, or the prefetched batches carried it to the agreed boundary
            assert_kept_the_step(attempts[0], logs(tmp_path / name), sent[name])
        else:
            assert "stopped_mid_step" not in attempts[0], (name, attempts)  # shielded: a clean stop
    usr2 = read_attempts(tmp_path / "usr2")  # the warning signal kills unshielded spawn workers (default action)
    assert [a["reason"] for a in usr2] == ["preemption", "finished"] and usr2[0]["signal"] == "USR2", usr2
    term = read_attempts(tmp_path / "term")
    assert [a["reason"] for a in term] == ["preemption", "finished"], (term, logs(tmp_path / "term"))
    assert term[0]["slurm"]["JobState"] == "RUNNING" and "scancel --signal=TERM" in term[0]["note"]


def test_a_preemption_by_slurms_sigterm_is_requeued_and_ends_as_the_rehearsal_does(sigterm_preemption: ClusterSpec,
                                                                                  tmp_path: Path) -> None:
    """Preempted as most clusters preempt (SIGTERM, SIGKILL after GraceTime; no warning signal): an own loop
    with unshielded fork workers and three intra-op threads a task (slurm.cpus_per_task=3), and a Task with
    loader workers: `preemption`, requeued, finished, and the same params_sha256 as the rehearsal of the same
    config, threads included."""
    # side by side on two 4-CPU nodes: 3 CPUs a node for the own loop, 1 for the Task; the own loop (about 40 s)
    # still trains when the Task, slower to start, has logged its first steps
    # W&B offline on the own loop: Slurm's SIGTERM ends W&B's service process too (issue 57)
    own = LOOP + ["train.max_steps=700", "slurm.cpus_per_task=3", "metrics.wandb=true", "metrics.wandb_mode=offline"]
    # the Task's steps take 0.1 s more on the cluster (numbers unchanged): 300 plain steps took a few seconds, and
    # one ran to its end before Slurm preempted it (ci48)
    task = TASK + ["train.max_steps=300", "slurm.tasks_per_node=1", "train.task=tests.tasks:Faulty"]
    jobs = {"own": submit(own, tmp_path / "own"), "task": submit(task, tmp_path / "task", fault="slow:-1:0.1")}
    assert wait_until(lambda: all(logged(tmp_path / name) >= 15 for name in jobs), 300)
    assert not any(finished(tmp_path / name) for name in jobs), "a job finished before it could be preempted"
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N3", "--exclusive", "--output=/dev/null",
                           "--wrap", "sleep 1"], capture_output=True, text=True, check=True).stdout.strip()
    for name, args in (("own", own), ("task", task)):  # the rehearsals run while Slurm preempts and requeues
        local = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", *args, "--local",
                                f"run_dir={tmp_path / (name + '-local')}"], cwd=ROOT, capture_output=True,
                               text=True, timeout=600, env={**os.environ, "HPC_DDP_TEST_LOADER": "fork"})
        assert local.returncode == 0, local.stderr[-3000:]
    assert wait_until(lambda: all(finished(tmp_path / name) for name in jobs), 300), (
        high, {name: (read_attempts(tmp_path / name), logs(tmp_path / name)) for name in jobs})
    for name in jobs:
        attempts = read_attempts(tmp_path / name)
        assert [(a["reason"], a["restart_count"]) for a in attempts] == [("preemption", 0), ("finished", 1)], (
            name, attempts, logs(tmp_path / name))
        assert attempts[0]["signal"] == "TERM" and attempts[0]["slurm"]["PreemptTime"] != "None", attempts[0]
        assert json.loads((tmp_path / name / "DONE.json").read_text())["params_sha256"] == json.loads(
            (tmp_path / f"{name}-local" / "DONE.json").read_text())["params_sha256"], name
    # the W&B run, read back with W&B's own reader, holds every step: what the SIGTERM cost attempt 0 in W&B,
    # attempt 1 sent again from metrics.jsonl
    fragments = wandb_fragments(tmp_path / "own")
    rows = wandb_history(fragments, (tmp_path / "own" / "wandb_id.txt").read_text().strip())
    history = {record["step"]: record for record in metrics_file.read(tmp_path / "own")}
    assert sorted(rows) == sorted(history) == list(range(1, 701)), ([f["size"] for f in fragments], len(rows))
    assert {s: rows[s]["loss"] for s in history} == pytest.approx({s: r["loss"] for s, r in history.items()})
