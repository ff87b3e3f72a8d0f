"""A newcomer's login-node mistakes: setup lines that cannot provide a missing module or script no longer
excuse it; the run is named by its last config file; submit and --dry-run say where the run dir is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core.config import load_config
from hpc_ddp.login.preflight.program import check_task, setup_changes

ROOT = Path(__file__).resolve().parents[2]
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


def test_a_rehearsed_loss_without_a_spare_numbers_attempts_as_status_does_and_says_how_to_hold_one(
        tmp_path: Path) -> None:
    """Left from earlier passes: the launcher's "attempt N" was the requeue count, not status's row; one death
    read "exit code -9" and then "137"; the no-spare hint did not name slurm.spare_nodes; a failed attempt's
    geometry was "-"."""
    run = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", str(MLP), "--local", "slurm.nodes=2",
                           "slurm.tasks_per_node=1", "train.max_steps=8", "slurm.max_failures=1", "--fail-at", "4",
                           f"run_dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[local] attempt 0 (requeue 0, job step 0) ended, killed by SIGKILL (137)" in proc.stderr
    assert "exit code -9" not in proc.stderr
    assert "no spare node was held: slurm.spare_nodes=1 holds one that takes a lost node's place" in proc.stderr
    assert "its first step is attempt 1, as status numbers them" in proc.stderr
    shown = subprocess.run([sys.executable, "-m", "hpc_ddp.status", str(run)], capture_output=True, text=True,
                           timeout=120).stdout
    rows = [line.split() for line in shown.splitlines() if line.startswith("  0 ") or line.startswith("  1 ")]
    assert rows[0][3] == "failed" and rows[0][5] == "2x1", shown  # the failed attempt's geometry, not "-"
    assert rows[1][3] == "finished", shown


def test_exit_codes_read_one_way() -> None:
    from hpc_ddp.core.codes import exit_words

    assert exit_words(-9) == exit_words(137) == "killed by SIGKILL (137)"
    assert exit_words(-15) == "killed by SIGTERM (143)" and exit_words(1) == "exit code 1"
