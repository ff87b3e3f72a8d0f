"""The global batch and node ranges: the plan per world size, and every refusal naming the key and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.core.batching import fitting_world_sizes, node_counts, plan, slurm_nodes
from hpc_ddp.core.config import load_config
from hpc_ddp.core.errors import ConfigError
from hpc_ddp.login.sbatch import sbatch_options, submitit_parameters

ROOT = Path(__file__).resolve().parents[2]
BASE = ["name=b", "train.task=examples.mlp:MLPTask", "train.max_steps=5", "train.batch_size=2"]


def cfg(*overrides: str):
    return load_config([], [*BASE, *overrides])


@pytest.mark.parametrize("world, accum", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_the_accumulation_follows_the_world_size_at_a_fixed_global_batch(world: int, accum: int) -> None:
    got = plan(cfg("train.global_batch_size=16").train, world)
    assert (got.grad_accum, got.global_batch, got.batch_size) == (accum, 16, 2)


def test_unset_the_global_batch_follows_the_world_size() -> None:
    assert plan(cfg("train.grad_accum=3").train, 4).global_batch == 2 * 3 * 4


def test_a_world_size_that_cannot_split_the_batch_lists_the_ones_that_can() -> None:
    with pytest.raises(ConfigError, match=r"(?s)cannot be split over 3 ranks.*among 1, 2, 4, 8") as err:
        plan(cfg("train.global_batch_size=16").train, 3)
    assert err.value.key == "train.global_batch_size"
    assert fitting_world_sizes(12, 2) == [1, 2, 3, 6]


@pytest.mark.parametrize("value, counts, text", [(2, [2], "2"), ("2-4", [2, 3, 4], "2-4"), (" 1 - 2 ", [1, 2], "1-2")])
def test_node_counts_and_ranges(value: object, counts: list[int], text: str) -> None:
    assert list(node_counts(value)) == counts and slurm_nodes(value) == text


@pytest.mark.parametrize("override, key, message", [
    ("slurm.nodes=3-1", "slurm.nodes", "a range MIN-MAX"),
    ("slurm.nodes=0-2", "slurm.nodes", "a range MIN-MAX"),
    ("slurm.nodes=two", "slurm.nodes", "a range MIN-MAX"),
])
def test_bad_node_values_name_the_key(override: str, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        cfg(override)
    assert err.value.key == key


def test_a_range_needs_a_fixed_global_batch() -> None:
    with pytest.raises(ConfigError, match=r"(?s)lets Slurm choose.*train.global_batch_size=2 \(the batch at 1 node\)") as err:
        cfg("slurm.nodes=1-2")
    assert err.value.key == "train.global_batch_size"


def test_a_script_or_loop_may_take_a_range_without_a_global_batch() -> None:
    for program in ("train.loop=tests.tasks.loops:ignores_stop", "train.script=train.py"):
        one = load_config([], ["name=b", program, "slurm.nodes=1-3"])
        assert list(node_counts(one.slurm.nodes)) == [1, 2, 3]


def test_a_range_with_counts_that_do_not_fit_is_refused_with_those_that_do() -> None:
    with pytest.raises(ConfigError, match=r"(?s)at 3 nodes x 2 tasks.*counts that fit: 1, 2, 4 \(e.g. slurm.nodes=1-2\)"):
        cfg("slurm.nodes=1-4", "slurm.tasks_per_node=2", "train.global_batch_size=16")
    with pytest.raises(ConfigError, match=r"(?s)at 3 nodes x 1 task .*use node counts among 1, 2, 4, 8") as err:
        cfg("slurm.nodes=3", "train.global_batch_size=16")
    assert err.value.key == "slurm.nodes"


def test_grad_accum_and_a_global_batch_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="drop train.grad_accum") as err:
        cfg("train.grad_accum=2", "train.global_batch_size=16")
    assert err.value.key == "train.grad_accum"


def test_a_range_reaches_sbatch_and_submitit_as_min_max() -> None:
    one = cfg("slurm.nodes=1-2", "slurm.tasks_per_node=2", "train.global_batch_size=16")
    assert "#SBATCH --nodes=1-2" in sbatch_options(one)
    params = submitit_parameters(one)
    assert params["nodes"] == 2 and params["additional_parameters"]["nodes"] == "1-2"  # submitit needs an int


def test_dry_run_shows_the_plan_for_each_count(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "--dry-run", "--no-preflight", *BASE,
                           f"run_dir={tmp_path / 'r'}", "slurm.nodes=1-2", "slurm.tasks_per_node=2",
                           "train.global_batch_size=16"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=1-2" in proc.stdout
    assert "1 node  -> 2 ranks x 2 samples x 4 micro-steps = global batch 16" in proc.stdout
    assert "2 nodes -> 4 ranks x 2 samples x 2 micro-steps = global batch 16" in proc.stdout


def test_the_elastic_warning_promises_float_rounding_only_without_randomness() -> None:
    """The warning said losses "agree to float rounding", untrue with dropout: every rank's RNG is reseeded."""
    from hpc_ddp.core.batching import geometry_change
    from hpc_ddp.core.config import load_config

    train = load_config([], ["name=x", "train.loop=a.b:c", "train.global_batch_size=32", "train.grad_accum=1",
                             "train.batch_size=4"]).train
    text = geometry_change(4, None, train, 2)
    assert "written by 4 ranks, now 2 ranks (accumulation 4, global batch 32)" in text
    assert "without dropout or other randomness, losses agree to float rounding" in text
    assert "with it, they follow another random stream" in text and geometry_change(2, None, train, 2) == ""
