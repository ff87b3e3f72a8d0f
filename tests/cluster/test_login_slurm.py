"""The login node's commands against the real local cluster: the emitted sbatch scripts run with plain
``sbatch`` (srun per task, and torchrun per node with a stop), preflight refuses what the cluster can never
run (an unknown partition, a job larger than the partition), and the docs' quickstart job works as
written. Their pure parts are tested beside the code they test (tests/login/, tests/test_docs_site.py);
these are here with the cluster's other tests and its fixtures (tests/cluster/conftest.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import MLP_300, finished, wait_until
from tests.login.test_sbatch import GOLDEN, emit, job_log, sbatch
from tests.test_docs_site import _run, quickstart_commands

if TYPE_CHECKING:
    from tests.cluster.conftest import Rehearsal

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slurm
def test_emitted_script_runs_with_plain_sbatch(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    """Today's emitted script, and (in the same wait) one emitted before the layout move, as a job that Slurm
    still held across an upgrade would run it: tests/golden/before_layout_move."""
    run_dir, script = tmp_path / "emitted", tmp_path / "job.sbatch"
    emit(script, "train.max_steps=50", f"run_dir={run_dir}")
    sbatch(script, cwd=tmp_path)  # submitted from elsewhere: the job still imports examples.mlp from ROOT
    old_dir = tmp_path / "before_move"
    old_script = script_from_before_the_move(old_dir)
    sbatch(old_script, cwd=tmp_path)
    assert wait_until(lambda: finished(run_dir), 180), job_log(run_dir)
    assert json.loads((run_dir / "DONE.json").read_text())["world_size"] == 4
    assert wait_until(lambda: finished(old_dir), 180), job_log(old_dir)
    assert json.loads((old_dir / "DONE.json").read_text())["world_size"] == 2
    assert [a["reason"] for a in read_attempts(old_dir)] == ["finished"]


def script_from_before_the_move(run_dir: Path) -> Path:
    """The srun script and config emitted by the code before the layout move, with this test's paths."""
    before = GOLDEN / "before_layout_move"

    def here(text: str) -> str:
        text = text.replace("/tmp/RUN_DIR_BEFORE_MOVE", str(run_dir)).replace("PYTHON=/work/main/.venv/bin/python",
                                                                             f"PYTHON={sys.executable}")
        return text.replace("WORKDIR=/work/main", f"WORKDIR={ROOT}")
    (run_dir / "slurm").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(here((before / "config.yaml").read_text()))
    script = run_dir.parent / "before_move.sbatch"
    script.write_text(here((before / "srun.sbatch").read_text()))
    return script


@pytest.mark.slurm
def test_torchrun_script_forwards_the_signal_requeues_once_and_matches_the_rehearsal(
        slurm_cluster: ClusterSpec, tmp_path: Path, mlp_300_reference: Callable[[], Rehearsal]) -> None:
    """One torchrun per node (c10d rendezvous on the first node); USR2 reaches the workers, not torchrun's death.
    Beside it, an unmodified torchrun-style script (train.script) under the same template, 2 nodes x 1: the
    worker under torchrun forwards the signal to its script, which resumes from its own snapshot (issue 27)."""
    options = [*MLP_300[1:], "slurm.timeout_min=30"]  # signalled at step ~50
    run_dir, script = tmp_path / "torchrun", tmp_path / "torchrun.sbatch"
    emit(script, "--launcher", "torchrun", *options, f"run_dir={run_dir}")
    script_dir, script_job_file = tmp_path / "script", tmp_path / "script.sbatch"
    emit(script_job_file, "--launcher", "torchrun", "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.timeout_min=30",
         "train.args=[--epochs,60,--save-every,1,--snapshot,'${run_dir}/snapshot.pt']", f"run_dir={script_dir}",
         config="examples/torchrun_script.yaml")
    job, script_job = sbatch(script), sbatch(script_job_file)
    metrics = run_dir / "metrics.jsonl"
    # each job is signalled once it is ready, whichever comes first (waiting for the script's snapshot first let
    # a loaded machine's torchrun job train to its end unsignalled)
    ready = {job: lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5,
             script_job: (script_dir / "snapshot.pt").exists}
    signalled: set[str] = set()

    def signal_when_ready() -> bool:
        for number, is_ready in ready.items():
            if number not in signalled and is_ready():
                subprocess.run(["scancel", "--signal=USR2", number], check=True)
                signalled.add(number)
        return len(signalled) == 2
    queue = lambda: subprocess.run(["squeue", "-o", "%i %T %R"], capture_output=True, text=True).stdout + \
        subprocess.run(["sinfo", "-R"], capture_output=True, text=True).stdout  # why a job pends, if it does
    assert wait_until(signal_when_ready, 300), job_log(run_dir) + job_log(script_dir) + queue()
    local = mlp_300_reference()  # started on this machine while Slurm requeues (if no test started it before)
    assert wait_until(lambda: finished(run_dir) and finished(script_dir), 180), job_log(run_dir) + job_log(script_dir)
    for ran, number in ((run_dir, job), (script_dir, script_job)):
        attempts = read_attempts(ran)
        assert [(a["reason"], a["restart_count"], a["job_id"]) for a in attempts] == [
            ("preemption", 0, int(number)), ("finished", 1, int(number))], (attempts, job_log(ran))
    script_log = job_log(script_dir, tail=10**7)
    # the worker forwarded the signal, or its script had just died of its peer's (the signal reaches nodes apart)
    assert ("forwarding SIGUSR2 to the script" in script_log or "just before SIGUSR2 reached this rank" in script_log) \
        and "resuming training from snapshot at epoch" in script_log, script_log[-6000:]
    done = json.loads((run_dir / "DONE.json").read_text())
    log = job_log(run_dir, tail=10**7)
    assert done["world_size"] == 4 and "rank 0/4 local 0/2 node 0/2" in log
    assert "source=torchrun" in log  # the workers took their ranks from torchrun
    assert done["params_sha256"] == json.loads((local.done() / "DONE.json").read_text())["params_sha256"]


@pytest.mark.slurm
def test_submit_with_an_unknown_partition_submits_nothing(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "slurm.partition=gpu",
                           f"run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout
    assert "nothing was submitted" in proc.stderr and "partition 'gpu' does not exist; sinfo lists debug, high" \
        in proc.stderr
    assert not (tmp_path / "run" / "job.json").exists()


def test_a_job_too_large_for_the_cluster_is_refused_and_one_that_waits_says_why(slurm_cluster: ClusterSpec,
                                                                                tmp_path: Path) -> None:
    """On the real 3-node cluster: --dry-run refuses slurm.nodes=4 (it passed and pended forever); submitted
    anyway (--no-preflight), submit names the logs that hold hpc_ddp's lines, and status shows PENDING with
    Slurm's reason in words, and exits 0 (it is queued)."""
    run = tmp_path / "too_big"
    base = [sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "slurm.nodes=4", f"run_dir={run}",
            "name=nlogin_too_big", "slurm.timeout_min=5"]
    dry = subprocess.run(base + ["--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 2, dry.stdout
    assert "partition 'debug' can never give more than 3" in dry.stdout and "HINT: set slurm.nodes=3" in dry.stdout
    sub = subprocess.run(base + ["--no-preflight"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert sub.returncode == 0, sub.stderr
    job = str(json.loads((run / "job.json").read_text())["job_id"])
    # the tail line points where hpc_ddp's lines, the user's logging and tracebacks go (it named the .out)
    assert f"tail     tail -f {run}/slurm/{job}_0_log.err {run}/slurm/{job}_0_log.out" in sub.stdout, sub.stdout
    assert f"run dir  {run}\n" in sub.stdout
    try:
        for _ in range(30):  # the controller sets the reason at its first scheduling pass
            out = subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(run)], cwd=tmp_path,
                                 capture_output=True, text=True, timeout=120)
            if "PartitionNodeLimit" in out.stdout or "PartitionConfig" in out.stdout:
                break
            time.sleep(1)
        assert "state PENDING" in out.stdout, out.stdout
        # Slurm 22.05 says PartitionNodeLimit or, at some scheduling passes, PartitionConfig: both in words
        assert re.search(r"waiting Partition(NodeLimit|Config): .*it will never start", out.stdout), out.stdout
        assert out.returncode == 0
    finally:
        subprocess.run(["scancel", job], timeout=30)


@pytest.mark.slurm
def test_quickstart_slurm_job_works_as_written(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    submit_cmd, status_cmd = quickstart_commands("3. A first Slurm job")
    proc = _run(submit_cmd, tmp_path)
    assert proc.returncode == 0 and "submitted job" in proc.stdout, proc.stderr[-2000:]
    assert wait_until(lambda: finished(tmp_path / "quickstart-slurm"), 240)
    status = _run(status_cmd, tmp_path)
    assert status.returncode == 0 and "state FINISHED" in status.stdout
