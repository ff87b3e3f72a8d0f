"""`python -m hpc_ddp.submit` against the real local cluster: submitit, requeue, status, refusals."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hpc_ddp.core.config import load_config
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import finished, job_gone, wait_until

if TYPE_CHECKING:
    from tests.cluster.conftest import Rehearsal

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slurm


def cli(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def job_id(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split("submitted job ", 1)[1].split(":", 1)[0]


def test_submit_runs_across_two_nodes_and_status_shows_it(slurm_cluster: ClusterSpec, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside it, on the third node, a script submitted with a cluster profile (in a temporary XDG_CONFIG_HOME)
    that sets the partition, a setup line and an srun argument: its rank sees all three, and status names it."""
    run_dir, profiled = tmp_path / "mlp", tmp_path / "profiled"
    proc = cli("hpc_ddp.submit", "examples/mlp.yaml", "slurm.nodes=2", "slurm.tasks_per_node=2",
               "train.max_steps=100", f"run_dir={run_dir}")
    job = job_id(proc)
    profiles = tmp_path / "xdg" / "hpc_ddp" / "profiles"
    profiles.mkdir(parents=True)
    (profiles / "local.yaml").write_text("slurm:\n  partition: debug\n  setup: ['export PROFILE_SET=from-setup']\n"
                                         "  srun_args: ['--export=ALL,PROFILE_SRUN=from-srun']\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    profile_job = job_id(cli("hpc_ddp.submit", "--profile", "local", "examples/torchrun_script.yaml",
                             "train.script=tests/tasks/env_script.py", "train.args=[]", "slurm.nodes=1",
                             "user.eval_every=7", f"run_dir={profiled}"))
    assert f"scancel {job}" in proc.stdout and f"python -m hpc_ddp.status {run_dir}" in proc.stdout
    assert wait_until(lambda: finished(run_dir), 180), proc.stdout
    script = (run_dir / "slurm" / f"{job}_submission.sh").read_text()
    assert "#SBATCH --signal=USR2@120" in script and "#SBATCH --requeue" in script
    assert "--kill-on-bad-exit=1" in script
    status = cli("hpc_ddp.status", str(run_dir))
    assert status.returncode == 0 and "state FINISHED" in status.stdout and re.search(r"finished +0->100", status.stdout)
    info = json.loads(cli("hpc_ddp.status", str(run_dir), "--json").stdout)
    assert info["done"]["world_size"] == 4 and info["attempts"][0]["job_id"] == int(job)
    assert wait_until(lambda: finished(profiled), 120), cli("hpc_ddp.status", str(profiled)).stdout
    assert "#SBATCH --partition=debug" in (profiled / "slurm" / f"{profile_job}_submission.sh").read_text()
    assert json.loads((profiled / "env-0.json").read_text()) == {
        "PROFILE_SET": "from-setup", "PROFILE_SRUN": "from-srun", "SLURM_JOB_PARTITION": "debug",
        "HPC_DDP_USER_EVAL_EVERY": "7", "HPC_DDP_USER": '{"eval_every": 7}'}
    status = cli("hpc_ddp.status", str(profiled))
    assert "profile local" in status.stdout and "state FINISHED" in status.stdout, status.stdout
    assert load_config([profiled / "config.yaml"]).profile == "local"


def test_a_stop_signal_gives_exactly_one_requeue_and_the_rehearsed_result(
        slurm_cluster: ClusterSpec, tmp_path: Path, rehearsal: Callable[..., Rehearsal]) -> None:
    options = ["train.max_steps=600", "train.log_every=10", "slurm.timeout_min=30"]  # far from the limit
    run_dir = tmp_path / "stopped"
    job = job_id(cli("hpc_ddp.submit", "examples/mlp.yaml", *options, f"run_dir={run_dir}"))
    metrics = run_dir / "metrics.jsonl"
    assert wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, 120)
    config = (run_dir / "config.yaml").read_bytes()
    for again in ([], ["--resume", "train.lr=0.5"]):  # refused either way, and the live run's config stays
        refused = cli("hpc_ddp.submit", "examples/mlp.yaml", *options, f"run_dir={run_dir}", *again)
        assert refused.returncode == 5 and f"is in use by job {job} (RUNNING)" in refused.stderr, refused.stderr
        assert (run_dir / "config.yaml").read_bytes() == config
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    local = rehearsal(tmp_path / "local", "examples/mlp.yaml", *options)  # while Slurm requeues the job
    assert wait_until(lambda: finished(run_dir), 180)
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a["restart_count"]) for a in attempts] == [("preemption", 0), ("finished", 1)]
    assert json.loads((run_dir / "DONE.json").read_text())["params_sha256"] == json.loads(
        (local.done() / "DONE.json").read_text())["params_sha256"]
    again = cli("hpc_ddp.submit", "examples/mlp.yaml", *options, f"run_dir={run_dir}")
    if again.returncode == 5:  # the run is over but Slurm still lists its job for a moment: said so
        assert "its run has finished" in again.stderr and "try again in a few seconds" in again.stderr, again.stderr
        assert wait_until(lambda: job_gone(job), 60)
        again = cli("hpc_ddp.submit", "examples/mlp.yaml", *options, f"run_dir={run_dir}")
    assert again.returncode == 2 and "--resume" in again.stderr and "earlier run" in again.stderr, again.stderr


def test_a_two_value_multirun_is_a_job_array_of_two_finished_runs(slurm_cluster: ClusterSpec,
                                                                   tmp_path: Path) -> None:
    proc = cli("hpc_ddp.submit", "examples/mlp.yaml", "--multirun", "train.lr=0.02,0.005", "slurm.nodes=2",
               "slurm.tasks_per_node=1", "train.max_steps=40", f"run_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    array = proc.stdout.split("submitted job array ", 1)[1].split(" ", 1)[0]
    runs = [tmp_path / "lr=0.02", tmp_path / "lr=0.005"]
    assert all(wait_until(lambda: finished(run), 240) for run in runs), proc.stdout
    for index, run in enumerate(runs):
        assert json.loads((run / "job.json").read_text())["job_id"] == f"{array}_{index}"
        assert load_config([run / "config.yaml"]).train.lr == [0.02, 0.005][index]
        info = json.loads(cli("hpc_ddp.status", str(run), "--json").stdout)
        assert info["state"] == "FINISHED" and info["done"]["world_size"] == 2
    first, second = (json.loads((run / "DONE.json").read_text())["params_sha256"] for run in runs)
    assert first != second  # the two learning rates really trained two different models


def test_scancel_snapshots_and_ends_the_job_without_a_requeue(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    """scancel sends SIGTERM like a preemption, but the job is already COMPLETING: keep the work, do not requeue."""
    options = ["train.max_steps=3000", "train.log_every=10", "slurm.timeout_min=30"]
    run_dir = tmp_path / "cancelled"
    job = job_id(cli("hpc_ddp.submit", "examples/mlp.yaml", *options, f"run_dir={run_dir}"))
    metrics = run_dir / "metrics.jsonl"
    assert wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, 120)
    subprocess.run(["scancel", job], check=True)
    assert wait_until(lambda: (run_dir / "attempts.jsonl").exists(), 60)
    assert wait_until(lambda: job_gone(job), 120)
    [attempt] = read_attempts(run_dir)
    assert attempt["reason"] == "cancelled" and not (run_dir / "DONE.json").exists()
    from hpc_ddp.rundir import snapshot

    assert snapshot.committed_steps(run_dir)[0] == attempt["last_step"]  # the work up to the cancel is kept
    resumed = cli("hpc_ddp.submit", "examples/mlp.yaml", *options, "train.max_steps=400", f"run_dir={run_dir}",
                  "--resume")
    job_id(resumed)
    assert wait_until(lambda: finished(run_dir), 180)
    assert read_attempts(run_dir)[-1]["resumed_from"] == attempt["last_step"]


def test_a_deterministic_error_on_the_cluster_ends_the_job_without_a_requeue(slurm_cluster: ClusterSpec,
                                                                            tmp_path: Path) -> None:
    """srun reports 143 (the ranks it terminated), not the error's 2: the ranks record the error themselves."""
    run_dir = tmp_path / "nope"
    job = job_id(cli("hpc_ddp.submit", "examples/mlp.yaml", "--no-preflight", "train.task=tests.tasks:Nope",
                     "slurm.max_failures=3", "slurm.nodes=2", "slurm.tasks_per_node=1", f"run_dir={run_dir}"))
    assert wait_until(lambda: job_gone(job), 120)
    [attempt] = read_attempts(run_dir)
    assert attempt["reason"] == "error" and attempt["restart_count"] == 0 and "Nope" in attempt["message"]
    restarts = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert "Restarts=0" in restarts or not restarts.strip()  # never went back to the queue
    log = "\n".join(p.read_text(errors="replace") for p in (run_dir / "slurm").glob("*_log.*"))
    assert "error; not requeued" in log, log[-3000:]


def test_scripts_are_judged_by_what_they_did_on_the_cluster(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    """Three scripts side by side (issues 23, 27). One crashes on rank 1: srun's --kill-on-bad-exit ends rank 0 with
    SIGTERM, and it is a failure (retried once in the job, then max_failures=0: no requeue), not a preemption
    requeued up to max_preemptions.
    The other goes on after USR2; Slurm's SIGTERM at the time limit (sent here with scancel, as the time-limit
    tests in test_slurm_real.py measure the real one) used to kill it with no ledger line: rank 0 now records
    the stop with what the script did and the hint, and requeues it before KillWait's SIGKILL. The third hangs
    after `step 3`: rank 0 records `hung` after dist.timeout_s instead of holding the nodes to the time limit."""
    crash_dir, deaf_dir, hang_dir = tmp_path / "crash", tmp_path / "deaf", tmp_path / "hang"
    crash = job_id(cli("hpc_ddp.submit", "examples/torchrun_script.yaml", "train.script=tests/tasks/crash_script.py",
                       "train.args=[]", "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.max_failures=0",
                       f"run_dir={crash_dir}"))
    hang = job_id(cli("hpc_ddp.submit", "examples/torchrun_script.yaml", "train.script=tests/tasks/hang_script.py",
                      "train.args=[]", "slurm.nodes=1", "slurm.tasks_per_node=1", "dist.timeout_s=3",
                      f"run_dir={hang_dir}"))
    deaf = job_id(cli("hpc_ddp.submit", "examples/torchrun_script.yaml", "train.script=tests/tasks/deaf_script.py",
                      "train.args=[--steps,3000]", "slurm.nodes=1", "slurm.tasks_per_node=2", "slurm.timeout_min=30",
                      f"run_dir={deaf_dir}"))
    out = lambda: "".join(p.read_text(errors="replace") for p in (deaf_dir / "slurm").glob("*_log.*"))  # noqa: E731
    # rank 0's own script (the one its ledger line judges): rank 1's can be steps ahead of it under load
    rank0 = lambda: "".join(p.read_text(errors="replace") for p in (deaf_dir / "slurm").glob("*_0_log.out"))  # noqa: E731
    assert wait_until(lambda: "step 5\n" in rank0(), 180), out()[-3000:]
    subprocess.run(["scancel", "--signal=USR2", deaf], check=True)
    assert wait_until(lambda: "the script went on after SIGUSR2" in out(), 60), out()[-3000:]
    subprocess.run(["scancel", "--signal=TERM", deaf], check=True)  # what the time limit sends
    assert wait_until(lambda: finished(deaf_dir), 180), out()[-3000:]
    stopped, done = read_attempts(deaf_dir)
    assert (stopped["reason"], stopped["stop_ignored"], done["reason"]) == ("preemption", "SIGUSR2", "finished")
    assert "still running when SIGTERM came" in stopped["note"] and stopped["last_step"] > 5, stopped
    assert "HINT: on the signal, save and exit" in out()
    assert wait_until(lambda: job_gone(crash) and job_gone(hang), 180)
    # each is retried once inside the job (issue 24), and not again: it failed twice with the run at one point
    hung = read_attempts(hang_dir)
    assert [(a["reason"], a["last_step"], a.get("in_job", 0)) for a in hung] == [("hung", 3, 0), ("hung", 3, 1)]
    attempts = read_attempts(crash_dir)
    # rank 0's worker records it (naming rank 1's script) unless srun's SIGKILL came first; then the batch shell
    assert [(a["reason"], a.get("in_job", 0)) for a in attempts] == [("failed", 0), ("failed", 1)], attempts
    crash_log = "".join(p.read_text(errors="replace") for p in (crash_dir / "slurm").glob("*_0_log.err"))
    assert "a retry in the job would most likely fail the same way" in crash_log, crash_log[-3000:]
    restarts = subprocess.run(["scontrol", "show", "job", crash], capture_output=True, text=True).stdout
    assert "Restarts=0" in restarts or not restarts.strip()  # never went back to the queue


def test_tasks_without_scontrol_are_requeued_once_by_the_batch_shell(slurm_cluster: ClusterSpec,
                                                                     tmp_path: Path) -> None:
    """A container started by srun often has no Slurm client (NVIDIA/pyxis#129): rank 0 cannot requeue, so
    the batch shell's settle step, which runs on the host, does it, and exactly once."""
    options = ["train.task=tests.tasks:NoSlurmClient", "train.max_steps=600", "train.log_every=10",
               "slurm.timeout_min=30"]
    run_dir = tmp_path / "container"
    job = job_id(cli("hpc_ddp.submit", "examples/mlp.yaml", *options, f"run_dir={run_dir}"))
    metrics = run_dir / "metrics.jsonl"
    assert wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, 120)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert wait_until(lambda: finished(run_dir), 180), cli("hpc_ddp.status", str(run_dir)).stdout
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a["restart_count"]) for a in attempts] == [("preemption", 0), ("finished", 1)], attempts
    assert attempts[0]["requeue_by"] == "batch shell"
    log = "\n".join(p.read_text(errors="replace") for p in (run_dir / "slurm").glob("*_log.*"))
    assert "requeued by the batch shell" in log and "scontrol is not on PATH in the job's tasks" in log


def test_own_loop_and_an_unmodified_script_survive_a_warning_signal_on_the_cluster(
        slurm_cluster: ClusterSpec, tmp_path: Path, rehearsal: Callable[..., Rehearsal]) -> None:
    """Tier 1 (train.loop, 2 nodes x 1 task) and tier 2 (train.script, 1 node x 2 tasks), submitted side by
    side and each sent USR2: requeued once by rank 0, resumed, finished; the own loop bit-exactly."""
    own = ["slurm.nodes=2", "slurm.tasks_per_node=1", "train.max_steps=40", "train.log_every=1",
           "snapshot.every_steps=15", "slurm.timeout_min=30"]
    script = ["slurm.nodes=1", "slurm.tasks_per_node=2", "slurm.timeout_min=30",
              "train.args=[--epochs,30,--save-every,1,--snapshot,'${run_dir}/snapshot.pt']"]  # quoted: YAML
    loop_dir, script_dir = tmp_path / "own", tmp_path / "script"
    loop_job = job_id(cli("hpc_ddp.submit", "examples/own_loop_gpt.yaml", *own, f"run_dir={loop_dir}"))
    script_job = job_id(cli("hpc_ddp.submit", "examples/torchrun_script.yaml", *script, f"run_dir={script_dir}"))
    signalled = set()
    ready = {loop_job: lambda: (loop_dir / "metrics.jsonl").exists() and len(
        (loop_dir / "metrics.jsonl").read_text().splitlines()) >= 4, script_job: (script_dir / "snapshot.pt").exists}

    def signal_when_ready() -> bool:
        for job, is_ready in ready.items():
            if job not in signalled and is_ready():
                subprocess.run(["scancel", "--signal=USR2", job], check=True)
                signalled.add(job)
        return len(signalled) == 2
    assert wait_until(signal_when_ready, 240), cli("hpc_ddp.status", str(script_dir)).stdout
    local = rehearsal(tmp_path / "local", "examples/own_loop_gpt.yaml", *own)  # while Slurm requeues the jobs
    assert wait_until(lambda: finished(loop_dir) and finished(script_dir), 300)
    for run_dir, job in ((loop_dir, loop_job), (script_dir, script_job)):
        attempts = read_attempts(run_dir)
        assert [(a["reason"], a["restart_count"], a["job_id"]) for a in attempts] == [
            ("preemption", 0, int(job)), ("finished", 1, int(job))], (attempts, "".join(
                p.read_text(errors="replace")[-3000:] for p in sorted((run_dir / "slurm").glob("*_log.*"))))
    logs = "".join(p.read_text(errors="replace") for p in (script_dir / "slurm").glob("*_log.out"))
    assert "resuming training from snapshot at epoch" in logs
    assert json.loads((loop_dir / "DONE.json").read_text())["params_sha256"] == json.loads(
        (local.done() / "DONE.json").read_text())["params_sha256"]


def test_a_node_range_starts_on_the_free_node_and_resumes_on_two(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    """slurm.nodes=1-2 while another job holds all nodes but one: the run starts on that one, is stopped and requeued,
    and continues on both nodes with the same global batch (the accumulation halves)."""
    blocker = subprocess.run(["sbatch", "--parsable", f"-N{slurm_cluster.nodes - 1}", "-c4", "-o", "/dev/null",
                              "--wrap", "sleep 600"],
                             capture_output=True, text=True, check=True).stdout.strip()
    try:
        assert wait_until(lambda: _squeue(blocker, "%T") == "RUNNING", 60)
        run_dir = tmp_path / "elastic"
        job = job_id(cli("hpc_ddp.submit", "examples/mlp.yaml", "slurm.nodes=1-2", "slurm.tasks_per_node=2",
                         "train.batch_size=4", "train.global_batch_size=32", "train.max_steps=1000",
                         "train.log_every=10", "slurm.timeout_min=30", f"run_dir={run_dir}"))
        metrics = run_dir / "metrics.jsonl"
        assert wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 120)
        assert _squeue(job, "%D") == "1"  # started on the one free node
    finally:
        subprocess.run(["scancel", blocker], check=True)
    assert wait_until(lambda: not _squeue(blocker, "%T"), 60)  # its node is free again
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert wait_until(lambda: finished(run_dir), 240), cli("hpc_ddp.status", str(run_dir)).stdout
    attempts = read_attempts(run_dir)
    assert [(a["reason"], a["nodes"], a["world_size"], a["grad_accum"]) for a in attempts] == [
        ("preemption", 1, 2, 4), ("finished", 2, 4, 2)]
    assert attempts[1]["resumed_from"] == attempts[0]["last_step"] > 0
    assert json.loads((run_dir / "DONE.json").read_text())["world_size"] == 4
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(10, 1001, 10))  # one continuous curve: no step lost or logged twice
    log = (run_dir / "slurm" / f"{job}_0_log.err").read_text(errors="replace")
    assert "at another world size: written by 2 ranks (accumulation 4, global batch 32), now 4 ranks" in log
    assert "1x2 accum 4" in cli("hpc_ddp.status", str(run_dir)).stdout


def _squeue(job: str, field: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", field], capture_output=True, text=True).stdout.strip()


def test_a_job_sbatch_refuses_is_a_clean_error_and_a_finished_run_stays_finished(slurm_cluster: ClusterSpec,
                                                                                 tmp_path: Path) -> None:
    """A newcomer's --resume of a rehearsed run without --local (or with a partition that does not exist) printed
    submitit's traceback, and the finished run's DONE.json and model.pt stayed set aside, so the run read as
    FAILED although nothing had run."""
    run_dir = tmp_path / "finished"
    first = cli("hpc_ddp.submit", "examples/mlp.yaml", "--local", "slurm.nodes=1", "slurm.tasks_per_node=1",
                "train.max_steps=5", f"run_dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    done = (run_dir / "DONE.json").read_text()
    proc = cli("hpc_ddp.submit", str(run_dir), "--resume", "train.max_steps=8", "--no-preflight",
               "slurm.partition=no-such-partition")
    assert proc.returncode == 2 and "error: sbatch refused the job, so nothing was queued" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "add --local" in proc.stderr and "partition" in proc.stderr
    assert (run_dir / "DONE.json").read_text() == done and (run_dir / "model.pt").exists()
    assert not (run_dir / "DONE-step-5.json").exists() and not (run_dir / "model-step-5.pt").exists()
