"""The rendered sbatch script: golden file, agreement with the submitit path, and a real sbatch run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hpc_ddp.core.config import load_config
from hpc_ddp.rundir.ledger import read_attempts
from hpc_ddp.login.sbatch import render, sbatch_options, submitit_parameters
from hpc_ddp.slurm_local import ClusterSpec
from hpc_ddp.login.dry_run import submitit_script
from tests.helpers import finished, wait_until

if TYPE_CHECKING:
    from tests.conftest import Rehearsal

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
REFRESH = "HPC_DDP_UPDATE_GOLDEN=1 python -m pytest tests/login/test_sbatch.py -k golden"
RENDERERS = {
    "ddp.sbatch": lambda cfg: render(cfg, "/runs/mlp/config.yaml", python="python", workdir="/home/me/my project"),
    "ddp_torchrun.sbatch": lambda cfg: render(cfg, "/runs/mlp/config.yaml", python="python", launcher="torchrun",
                                              workdir="/home/me/my project"),
    "submitit.sbatch": lambda cfg: submitit_script(cfg, python="python"),
    "submitit_array.sbatch": lambda cfg: submitit_script(cfg, array=4, python="python", cfgs=[cfg] * 4),
}


def golden_config():
    return load_config([ROOT / "examples" / "mlp.yaml"], [
        "run_dir=/runs/mlp", "slurm.partition=gpu", "slurm.gpus_per_node=2", "slurm.mem_gb=64",
        "slurm.setup=[module load cuda/12.4, source /envs/ddp/bin/activate]", "slurm.srun_args=[--cpu-bind=cores]",
        "slurm.sbatch_extra.mail-type=END"])


@pytest.mark.parametrize("name", sorted(RENDERERS))
def test_rendered_script_matches_the_golden_file(name: str) -> None:
    text = RENDERERS[name](golden_config())
    if os.environ.get("HPC_DDP_UPDATE_GOLDEN") == "1":
        (GOLDEN / name).write_text(text)
    assert text == (GOLDEN / name).read_text(), (
        f"the rendered {name} changed; if intended, refresh the golden files with: {REFRESH}")


def test_torchrun_flavour_gives_each_node_one_task_with_all_its_cpus() -> None:
    options = sbatch_options(load_config([ROOT / "examples" / "mlp.yaml"], ["slurm.tasks_per_node=4",
                                                                          "slurm.cpus_per_task=3"]), "torchrun")
    assert "#SBATCH --ntasks-per-node=1" in options and "#SBATCH --cpus-per-task=12" in options


def test_template_and_submitit_path_ask_for_the_same_things(tmp_path: Path) -> None:
    from submitit.slurm.slurm import _make_sbatch_string  # submitit's renderer, to catch drift between paths

    cfg = golden_config()
    script = _make_sbatch_string(command="x", folder=tmp_path, **submitit_parameters(cfg))
    ours = [line for line in sbatch_options(cfg) if "--output=" not in line]
    assert [line for line in ours if line not in script.splitlines()] == []


def emit(script: Path, *args: str, config: str = "examples/mlp.yaml") -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", config, "--emit-sbatch", str(script),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"sbatch {script}" in proc.stdout, proc.stderr


def sbatch(script: Path, cwd: Path = ROOT) -> str:
    out = subprocess.run(["sbatch", "--parsable", str(script)], cwd=cwd, check=True, capture_output=True, text=True)
    return out.stdout.strip().split(";")[0]


def job_log(run_dir: Path, tail: int = 4000) -> str:
    return "\n".join(p.read_text(errors="replace")[-tail:] for p in (run_dir / "slurm").glob("*.out"))


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
        slurm_cluster: ClusterSpec, tmp_path: Path, rehearsal: Callable[..., Rehearsal]) -> None:
    """One torchrun per node (c10d rendezvous on the first node); USR2 reaches the workers, not torchrun's death.
    Beside it, an unmodified torchrun-style script (train.script) under the same template, 2 nodes x 1: the
    worker under torchrun forwards the signal to its script, which resumes from its own snapshot (issue 27)."""
    options = ["train.max_steps=300", "train.log_every=10", "slurm.timeout_min=30"]  # signalled at step ~50
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
    local = rehearsal(tmp_path / "local", "examples/mlp.yaml", *options)  # on this machine while Slurm requeues
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
