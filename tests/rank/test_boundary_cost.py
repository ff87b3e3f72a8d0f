"""What a run.boundary does per call, counted (issue 47, B15): one rank agrees without a collective, the
just-in-time snapshot's copies are made only of what changed and still hold the newest state, and the derived
RNG stays a function of (seed, step, rank) whatever the loop drew. No clocks: counts and states."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc_ddp.core.config import load_config
from hpc_ddp.core.slurm_env import from_environ
from hpc_ddp.core.stopping import StopFlag
from hpc_ddp.rank.group import control
from hpc_ddp.rank.loop.run import Run
from hpc_ddp.rank.salvage.held import Held
from hpc_ddp.rank.salvage.held_copies import plain_copy
from hpc_ddp.rank.state.rng import capture_rng
from tests.helpers import done, losses, submit


def one_rank(tmp_path: Path, stop: StopFlag | None = None, *overrides: str) -> Run:
    """A world-size-1 run object with no process group at all: whatever it needs a collective for fails."""
    cfg = load_config([], ["name=b15", f"run_dir={tmp_path}", "train.loop=a.b:c", *overrides])
    return Run(cfg, from_environ({}), torch.device("cpu"), checkpointer=None, stop=stop)


def test_one_rank_agrees_with_itself_without_a_collective_and_stops_one_boundary_after_the_signal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-element gloo all_reduce of one rank cost 25-50 µs a boundary, and milliseconds at p99 when its thread
    waited for a core. One rank's flags are its own: kept as they are, read at the next boundary, so the stop
    still lands on the step it landed on with the collective (one boundary after the signal)."""
    def no_collective(*args: object, **kwargs: object) -> None:
        raise AssertionError("a collective at a boundary of one rank")

    monkeypatch.setattr(control, "start_max", no_collective)
    monkeypatch.setattr(torch.distributed, "all_reduce", no_collective)
    flag = StopFlag()
    run = one_rank(tmp_path, flag)
    run.resume(model=torch.nn.Linear(2, 1))
    assert [run.boundary(step) for step in (1, 2, 3)] == [False] * 3
    flag._handle(signal.SIGUSR2, None)  # the signal arrives during step 4
    assert run.boundary(4) is False  # agreed at 4, acted on at 5: as with the all_reduce
    assert run.boundary(5) is True and run.stopped


def test_an_optimizer_group_is_copied_only_where_a_setting_changed_and_the_copy_holds_the_newest() -> None:
    """The GPT loop sets the learning rate before every step: one setting of twelve changed, one copied. An
    unchanged group keeps the last boundary's copy; a tensor rate (updated in place) is cloned every time."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW([{"params": model[0].parameters()},
                                   {"params": model[1].parameters(), "lr": torch.tensor(0.01)}], lr=0.1)
    held = Held({"model": model, "optimizer": optimizer})
    settings = len(optimizer.param_groups[0]) - 1
    held.mark(1)
    first = held.copies["optimizer"]
    assert held.settings_copied == 2 * settings  # the first boundary copies every setting of both groups
    held.mark(2)
    assert held.copies["optimizer"][0] is first[0]  # nothing changed: the same copy
    assert held.copies["optimizer"][1] is not first[1]  # a tensor setting: copied again, whole
    assert held.settings_copied == 3 * settings
    optimizer.param_groups[0]["lr"] = 0.05  # the schedule, before step 3
    held.mark(3)
    assert held.settings_copied == 4 * settings + 1  # one setting of the first group, the second group whole
    groups = held.whole()[1]["optimizer"]["param_groups"]  # type: ignore[index]
    assert groups[0]["lr"] == 0.05 and first[0]["lr"] == 0.1  # the newest in the new copy; the old one untouched
    optimizer.param_groups[0]["lr"] = 0.01  # after the boundary: the held step keeps its own rate
    assert held.whole()[1]["optimizer"]["param_groups"][0]["lr"] == 0.05  # type: ignore[index]
    optimizer.param_groups[1]["lr"].fill_(0.5)  # a scheduler's in-place update of a tensor rate
    assert float(held.whole()[1]["optimizer"]["param_groups"][1]["lr"]) == pytest.approx(0.01)  # type: ignore[index]


def test_a_new_or_mutable_setting_copies_the_group_whole_and_a_resume_loads_it() -> None:
    """A setting added to a group, or one that can change in place (a list), is never taken for unchanged."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    held = Held({"model": model, "optimizer": optimizer})
    held.mark(1)
    optimizer.param_groups[0]["note"] = [1, 2]  # a user's own setting, mutable
    held.mark(2)
    copied = held.copies["optimizer"][0]
    assert copied["note"] == [1, 2] and copied["note"] is not optimizer.param_groups[0]["note"]
    optimizer.param_groups[0]["note"].append(3)
    held.mark(3)
    assert held.copies["optimizer"][0]["note"] == [1, 2, 3] and copied["note"] == [1, 2]
    state = held.whole()[1]["optimizer"]  # type: ignore[index]
    torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=1.0).load_state_dict(state)


def test_a_plain_state_is_copied_without_deepcopy_and_anything_else_still_deeply() -> None:
    """A sampler's position or a scheduler's state (numbers, lists, dicts): a copy the loop's later changes
    cannot reach, made without deepcopy's bookkeeping; an object inside it is still deep-copied."""
    class Box:
        def __init__(self) -> None:
            self.items = [1]

    state = {"epoch": 1, "lrs": [0.1, 0.2], "nested": {"k": (1, [2])}, "box": Box()}
    copied = plain_copy(state)
    state["lrs"].append(0.3)
    state["nested"]["k"][1].append(3)
    state["box"].items.append(2)
    assert copied["lrs"] == [0.1, 0.2] and copied["nested"]["k"] == (1, [2]) and copied["box"].items == [1]


def test_a_samplers_position_held_at_a_boundary_is_that_boundarys_after_the_loop_draws_on(tmp_path: Path) -> None:
    """The just-in-time snapshot's sampler position, taken at the boundary, not the live one the next step moved."""
    from torch.utils.data import DataLoader

    from hpc_ddp.rank.loop.sampler import ShardSampler

    sampler = ShardSampler(64, 0, 1, seed=0, global_batch=4)
    loader = DataLoader(list(range(64)), batch_size=4, sampler=sampler)
    run = one_rank(tmp_path)
    run.resume(model=torch.nn.Linear(2, 1), sampler=sampler)
    batches = sampler.iterate(loader)
    next(batches)
    run.boundary(1)
    next(batches)  # step 2 draws its batch, then fails before its boundary
    assert run.held is not None
    assert run.held.whole()[1]["sampler"] == {"epoch": 0, "sample_in_epoch": 4}  # type: ignore[index]
    assert sampler.state_dict() == {"epoch": 0, "sample_in_epoch": 8}


def test_after_a_boundary_every_generator_is_the_steps_whatever_the_loop_drew(tmp_path: Path) -> None:
    """Every generator is reseeded at every boundary, also one the loop never touched: skipping it would leave
    it at an older step's state, where a run resumed at this step starts it at this step's, and the first draw
    after the gap would differ. So a loop that draws from Python, NumPy and torch in some steps and not in
    others has, after each boundary, exactly the states of one that never draws (and of a resumed run)."""
    def states(run: Run, draws: set[int]) -> list[dict]:
        run.resume(model=torch.nn.Linear(2, 1))
        seen = [capture_rng()]
        for step in range(1, 6):
            if step in draws:  # the loop draws now and then (an evaluation, an augmentation)
                random.random(), np.random.rand(), torch.rand(3)
            run.boundary(step)
            seen.append(capture_rng())
        return seen

    assert states(one_rank(tmp_path / "a"), {2, 5}) == states(one_rank(tmp_path / "b"), set())


@pytest.mark.slow
def test_one_rank_stopped_twice_ends_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    """The GPT example at 1 x 1 (its stop agreed without a collective), dropout, a preemption and a time-out:
    every step's loss and the final parameters equal those of a run that never stopped."""
    one = ["examples/own_loop_gpt.yaml", "--local", "slurm.nodes=1", "slurm.tasks_per_node=1",
           "train.max_steps=10", "train.log_every=1", "snapshot.every_steps=4"]
    stopped = submit(*one, f"run_dir={tmp_path / 'stopped'}", "--preempt-at", "3", "--timeout-at", "7")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    straight = submit(*one, f"run_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert losses(tmp_path / "stopped") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 10
    assert done(tmp_path / "stopped")["params_sha256"] == done(tmp_path / "straight")["params_sha256"]
