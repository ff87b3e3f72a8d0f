"""The rendered sbatch script: golden file, agreement with the submitit path, and a real sbatch run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core.config import load_config
from hpc_ddp.login.sbatch import render, sbatch_options, submitit_parameters
from hpc_ddp.login.dry_run import submitit_script

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

