"""``--resume`` of a finished run (hpc_ddp.login.finished): trains on only when no limit ends it where it finished.

A run stops at whichever of ``train.max_steps`` and ``train.epochs`` comes first. Raising one while the
other still ends the run at the finished step took an allocation to train nothing (issue 36): refused on the
login node, naming the key that still ends it and the value to give it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_ddp.core.config import flat_values, load_config, save_config
from hpc_ddp.core.errors import HpcDdpError
from hpc_ddp.login.finished import check, nothing_to_train

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.yaml")


def cfg(*overrides: str):  # noqa: ANN201
    return load_config([MLP], ["run_dir=/runs/x", *overrides])


@pytest.mark.parametrize(("before", "now", "done", "refused"), [
    # finished by max_steps at step 20 (epoch 1 of 5)
    (["train.max_steps=20", "train.epochs=5"], ["train.max_steps=20", "train.epochs=9"], {"step": 20, "epoch": 1},
     "train.max_steps=20 would end it there again"),  # epochs raised, max_steps still reached: the bug
    (["train.max_steps=20", "train.epochs=5"], ["train.max_steps=40", "train.epochs=5"], {"step": 20, "epoch": 1},
     None),
    # finished by epochs at step 32 (epoch 2 of 2), max_steps far away
    (["train.max_steps=1000", "train.epochs=2"], ["train.max_steps=1000", "train.epochs=2"], {"step": 32, "epoch": 2},
     "train.epochs=2 would end it there again"),  # nothing raised, yet max_steps > step: accepted before
    (["train.max_steps=1000", "train.epochs=2"], ["train.max_steps=2000", "train.epochs=2"], {"step": 32, "epoch": 2},
     "train.epochs=2 would end it there again"),
    (["train.max_steps=1000", "train.epochs=2"], ["train.max_steps=1000", "train.epochs=3"], {"step": 32, "epoch": 2},
     None),
    (["train.max_steps=20", "train.epochs=2"], ["train.max_steps=20", "train.epochs=2"], {"step": 20, "epoch": 2},
     "train.max_steps=20 and train.epochs=2 would end it there again"),
    # one limit only
    (["train.max_steps=20"], ["train.max_steps=20"], {"step": 20}, "train.max_steps=20 would end it there again"),
    (["train.max_steps=20"], ["train.max_steps=21"], {"step": 20}, None),
    (["train.max_steps=null", "train.epochs=2"], ["train.max_steps=null", "train.epochs=3"], {"step": 32}, None),
])
def test_a_resume_trains_on_only_when_every_set_limit_allows_more(before: list[str], now: list[str], done: dict,
                                                                  refused: str | None) -> None:
    problem = nothing_to_train(cfg(*now), done, flat_values(cfg(*before)))
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem and "would train nothing more" in problem


def test_the_refusal_says_which_key_still_ends_the_run_and_what_to_raise_it_to(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(load_config([MLP], [f"run_dir={run_dir}", "train.max_steps=20", "train.epochs=5"]),
                run_dir / "config.yaml")
    (run_dir / "DONE.json").write_text(json.dumps({"step": 20, "epoch": 1, "world_size": 4}))
    with pytest.raises(HpcDdpError) as err:
        check(load_config([run_dir / "config.yaml"], ["train.epochs=9"]))  # what --resume train.epochs=9 checks
    text = str(err.value)
    assert err.value.key == "train.max_steps"
    assert "train.epochs=9 would allow more, but the run stops at whichever of train.max_steps and train.epochs " \
           "comes first" in text
    assert "HINT: raise train.max_steps on this command line to train it longer (--resume train.max_steps=40)" in text
    check(load_config([run_dir / "config.yaml"], ["train.epochs=9", "train.max_steps=40"]))  # trains on


def test_a_finished_run_trained_longer_is_told_where_it_goes_on_from(tmp_path: Path) -> None:
    """Before the finish committed a snapshot of its step, a finished run trained longer went on from an older
    snapshot, or from step 0, and said "it goes on from its newest snapshot" either way (a newcomer's metrics
    were replaced in silence). Now the line names the step, and warns when finished steps would be redone."""
    from hpc_ddp.login.finished import goes_on_from
    from hpc_ddp.rundir import snapshot

    kept = tmp_path / "DONE-step-80.json"
    kept.write_text(json.dumps({"step": 80}))
    assert goes_on_from(tmp_path, kept).startswith("WARNING: it has no snapshot, so it starts again from step 0 "
                                                   "and trains the 80 finished steps again")
    for step in (40, 80):
        directory = snapshot.step_dir(tmp_path, step)
        directory.mkdir(parents=True)
        snapshot.commit(directory, step, [], world_size=1, config_hash="h")
        said = goes_on_from(tmp_path, kept)
        assert said == ("it goes on from step 80, where it finished" if step == 80 else "WARNING: its newest "
                        "snapshot is step 40, not the step it finished at (80): steps 41-80 are trained again "
                        "(their rows in metrics.jsonl are replaced)")
