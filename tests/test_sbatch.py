"""The rendered sbatch script: golden file, agreement with the submitit path, and a real sbatch run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.config import load_config
from hpc_ddp.sbatch import render, sbatch_options, submitit_parameters
from hpc_ddp.slurm_local import ClusterSpec
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "ddp.sbatch"
REFRESH = "HPC_DDP_UPDATE_GOLDEN=1 python -m pytest tests/test_sbatch.py -k golden"


def golden_config():
    return load_config([ROOT / "examples" / "mlp.yaml"], [
        "run_dir=/runs/mlp", "slurm.partition=gpu", "slurm.gpus_per_node=2", "slurm.mem_gb=64",
        "slurm.setup=[module load cuda/12.4, source /envs/ddp/bin/activate]", "slurm.srun_args=[--cpu-bind=cores]",
        "slurm.sbatch_extra.mail-type=END"])


def test_rendered_script_matches_the_golden_file() -> None:
    text = render(golden_config(), "/runs/mlp/config.yaml", python="python")
    if os.environ.get("HPC_DDP_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"the rendered sbatch script changed; if intended, refresh with: {REFRESH}"


def test_template_and_submitit_path_ask_for_the_same_things(tmp_path: Path) -> None:
    from submitit.slurm.slurm import _make_sbatch_string  # submitit's renderer, to catch drift between paths

    cfg = golden_config()
    script = _make_sbatch_string(command="x", folder=tmp_path, **submitit_parameters(cfg))
    ours = [line for line in sbatch_options(cfg) if "--output=" not in line]
    assert [line for line in ours if line not in script.splitlines()] == []


@pytest.mark.slurm
def test_emitted_script_runs_with_plain_sbatch(slurm_cluster: ClusterSpec, tmp_path: Path) -> None:
    run_dir, script = tmp_path / "emitted", tmp_path / "job.sbatch"
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--emit-sbatch", str(script),
                           "train.max_steps=50", f"run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and f"sbatch {script}" in proc.stdout, proc.stderr
    subprocess.run(["sbatch", str(script)], cwd=ROOT, check=True, capture_output=True)
    wait_until((run_dir / "DONE.json").exists, 180)
    assert json.loads((run_dir / "DONE.json").read_text())["world_size"] == 4, list((run_dir / "slurm").glob("*"))
