"""A newcomer's login-node mistakes: setup lines that cannot provide a missing module or script no longer
excuse it; the run is named by its last config file; submit and --dry-run say where the run dir is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core.config import load_config
from hpc_ddp.login.preflight_program import check_task, setup_changes

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "mlp.yaml"


def config(*overrides: str):
    return load_config([MLP], list(overrides))


@pytest.mark.parametrize("line, env, cd", [
    ("export OMP_NUM_THREADS=1", False, False), ("export NCCL_DEBUG=INFO", False, False), ("ulimit -n 4096", False, False),
    ("source ~/venv/bin/activate", True, False), ("module load python/3.11", True, False),
    ("conda activate train", True, False), ("export PYTHONPATH=$HOME/src:$PYTHONPATH", True, False),
    ("cd $HOME/project", True, True), ("mkdir -p x && cd x", True, True), (". env.sh", True, False),
])
def test_which_setup_lines_may_change_the_module_or_the_directory(line: str, env: bool, cd: bool) -> None:
    found_env, found_cd = setup_changes([line])
    assert (found_env == line) is env and (found_cd == line) is cd


def test_a_setup_line_that_cannot_provide_the_module_leaves_it_an_error() -> None:
    """Any setup line turned "not importable" into a warning, so `--dry-run && submit` let a submit from the
    wrong directory through."""
    [missing] = check_task(config("train.task=nowhere.tasks:Task", "slurm.setup=[export OMP_NUM_THREADS=1]"),
                           search=[])
    assert missing.level == "error"
    [maybe] = check_task(config("train.task=nowhere.tasks:Task", "slurm.setup=[module load py]"), search=[])
    assert maybe.level == "warning" and "slurm.setup line 'module load py' may provide it" in maybe.message


def test_a_missing_script_is_an_error_unless_a_setup_line_changes_directory(tmp_path: Path) -> None:
    script = ("train.task=null", "train.script=nowhere/train.py")
    [plain] = check_task(config(*script, "slurm.setup=[source env/bin/activate]"))
    assert plain.level == "error" and "train.script=nowhere/train.py does not exist" in plain.message
    [moved] = check_task(config(*script, "slurm.setup=['cd /scratch/me/project']"))
    assert moved.level == "warning" and "'cd /scratch/me/project' changes the directory" in moved.message
    [absolute] = check_task(config("train.task=null", f"train.script={tmp_path}/no.py", "slurm.setup=[cd /x]"))
    assert absolute.level == "error"


def test_the_run_is_named_by_the_last_config_file(tmp_path: Path) -> None:
    """`submit cluster.yaml loop.yaml` named the run `cluster` (the defaults file stacked first)."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("slurm:\n  timeout_min: 30\n")
    assert load_config([cluster, MLP]).name == "mlp"
    named = tmp_path / "named.yaml"
    named.write_text("name: mine\n")
    assert load_config([named, MLP]).name == "mine"  # a file that sets name wins, wherever it is


def test_dry_run_says_where_the_run_dir_is_and_what_it_is_relative_to(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", str(MLP), "--dry-run", "--no-preflight"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"run dir {tmp_path.resolve() / 'runs' / 'mlp'} (under the directory you submit from: a relative " \
           "run_dir is resolved against it, not against the config file's directory)" in proc.stdout
