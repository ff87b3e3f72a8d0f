""""Did you mean" for what newcomers type most: other tools' names (lr, learning_rate, slurm.time, slurm.gpus),
a key in the wrong section, and sbatch flags on submit's command line (--nodes=2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core.config import load_config
from hpc_ddp.core.config.hints import flag_hint, suggest
from hpc_ddp.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp.yaml"


@pytest.mark.parametrize("typed, meant", [
    ("lr", "train.lr"), ("learning_rate", "train.lr"), ("train.learning_rate", "train.lr"),
    ("slurm.time", "slurm.timeout_min"), ("slurm.gpus", "slurm.gpus_per_node"), ("max_steps", "train.max_steps"),
    ("slurm.lr", "train.lr"), ("nodes", "slurm.nodes"), ("train.max_step", "train.max_steps"),
    ("dist.timeout", "dist.timeout_s"), ("train.eval_every", "train.log_every"), ("model.hidden", None),
])
def test_a_mistyped_key_is_matched_to_the_key_it_stands_for(typed: str, meant: str | None) -> None:
    assert suggest(typed) == meant


@pytest.mark.parametrize("override, hint", [
    ("lr=0.1", "did you mean train.lr?"), ("learning_rate=0.1", "did you mean train.lr?"),
    ("slurm.time=60", "did you mean slurm.timeout_min?"), ("slurm.gpus=4", "did you mean slurm.gpus_per_node?"),
])
def test_the_config_error_names_the_key(override: str, hint: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([MLP], [override])
    assert f"HINT: {hint}" in str(err.value)


def test_a_mistyped_key_in_a_yaml_file_gets_the_same_hint(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"did you mean train\.lr\?"):
        load_config([MLP, tmp_path / "c.yaml"])


@pytest.mark.parametrize("arg, hint", [
    ("--nodes=2", "--nodes=2 -> slurm.nodes=2"), ("--time=2:00:00", "slurm.timeout_min=120"),
    ("--gres=gpu:4", "slurm.gpus_per_node=4"), ("--mem=64G", "slurm.mem_gb=64"), ("-p", "slurm.partition=VALUE"),
    ("--lr=0.1", "train.lr=0.1"), ("--max-steps=9", "train.max_steps=9"), ("--exclusive", "slurm.exclusive=true"),
    ("--verbose", None), ("train.lr=1", None),
])
def test_an_sbatch_flag_is_turned_into_the_override(arg: str, hint: str | None) -> None:
    found = flag_hint(arg)
    assert (found is None) if hint is None else (hint in found)


def test_submit_with_sbatch_flags_says_which_overrides_to_type() -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--nodes=2", "-t", "30",
                           "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unrecognized arguments: --nodes=2 -t 30" in proc.stderr
    assert "--nodes=2 -> slurm.nodes=2; -t 30 -> slurm.timeout_min=30" in proc.stderr
