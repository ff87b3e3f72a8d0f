"""--multirun expansion (pure): combinations, labels, refusals."""

from __future__ import annotations

import pytest

from hpc_ddp.core.errors import ConfigError
from hpc_ddp.login.sweep import expand, split_top_level


def test_two_axes_give_the_cartesian_product_in_order() -> None:
    combos = expand(["train.lr=0.1,0.01", "train.seed=1,2", "train.max_steps=5"])
    assert [c.label for c in combos] == ["lr=0.1,seed=1", "lr=0.1,seed=2", "lr=0.01,seed=1", "lr=0.01,seed=2"]
    assert combos[1].overrides == ("train.max_steps=5", "train.lr=0.1", "train.seed=2")


def test_commas_inside_lists_and_quotes_are_not_sweeps() -> None:
    assert split_top_level("[a,b],[c]") == ["[a,b]", "[c]"]
    assert split_top_level("'x,y',z") == ["'x,y'", "z"]
    combos = expand(["slurm.srun_args=[--a,--b]", "train.lr=1,2"])
    assert [c.overrides[0] for c in combos] == ["slurm.srun_args=[--a,--b]"] * 2


def test_unsafe_characters_in_values_become_underscores_in_the_label() -> None:
    assert expand(["train.task=a.b:C,a.b:D"])[0].label == "task=a.b_C"


@pytest.mark.parametrize(("overrides", "key", "words"), [
    (["train.lr=0.1"], "--multirun", "nothing to sweep"),
    (["slurm.nodes=1,2"], "slurm.nodes", "cannot vary slurm.nodes"),
    (["run_dir=a,b"], "run_dir", "cannot vary run_dir"),
    (["train.lr=0.1,"], "train.lr", "empty sweep value"),
    (["train.lr"], "train.lr", "has no '='"),
    (["train.task=a:b/c,a:b_c"], "--multirun", "same run dir name"),
])
def test_bad_sweeps_are_refused_naming_the_key(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand(overrides)
    assert info.value.key == key and words in str(info.value) and "HINT" in str(info.value)
