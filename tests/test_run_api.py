"""Units of the public run API: the sampler's position, loading a loop function, the program keys,
and the run object's rules (no process group needed: no checkpointer, no stop flag)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from hpc_ddp import layout
from hpc_ddp.config import load_config
from hpc_ddp.errors import ConfigError
from hpc_ddp.run import Run, RunUsageError
from hpc_ddp.sampler import ShardSampler
from hpc_ddp.slurm_env import from_environ
from hpc_ddp.task import TaskError, load_loop


def taken(sampler: ShardSampler, loader: DataLoader, count: int) -> list[list[int]]:
    batches = []
    while len(batches) < count:
        for batch in sampler.iterate(loader):
            batches.append(batch.tolist())
            if len(batches) == count:
                break
    return batches


def test_the_sampler_position_counts_what_the_loop_took_and_resumes_across_epochs() -> None:
    data = list(range(20))
    straight = ShardSampler(20, rank=1, world_size=2, seed=3)
    reference = taken(straight, DataLoader(data, batch_size=3, sampler=straight, drop_last=True), 7)
    first = ShardSampler(20, rank=1, world_size=2, seed=3)
    head = taken(first, DataLoader(data, batch_size=3, sampler=first, drop_last=True), 4)  # epoch 0 ends at 3
    state = first.state_dict()
    assert state == {"epoch": 1, "sample_in_epoch": 6}  # global: 3 samples on each of the 2 ranks
    second = ShardSampler(20, rank=1, world_size=2, seed=3)
    second.load_state_dict(state)
    tail = taken(second, DataLoader(data, batch_size=3, sampler=second, drop_last=True), 3)
    assert head + tail == reference


def test_iterate_refuses_a_loader_built_on_another_sampler() -> None:
    sampler = ShardSampler(8, 0, 1)
    with pytest.raises(ValueError, match="sampler=this sampler"):
        next(sampler.iterate(DataLoader(list(range(8)), batch_size=2)))


@pytest.mark.parametrize("path, message", [
    ("tests.tasks.loops:no_argument", "cannot be called with the run as its one argument"),
    ("tests.tasks.loops:nothing_here", "has no 'nothing_here'"),
    ("tests.tasks:SimpleTask", "is a type, not a function"),
])
def test_a_loop_that_cannot_take_the_run_is_refused_naming_the_key(path: str, message: str) -> None:
    with pytest.raises(TaskError, match=message) as err:
        load_loop(path)
    assert err.value.key == "train.loop"


def test_exactly_one_program_key() -> None:
    with pytest.raises(ConfigError, match="train.loop and train.script are both set"):
        load_config([], ["name=x", "train.loop=a.b:c", "train.script=t.py"])
    with pytest.raises(ConfigError, match="nothing to train"):
        load_config([], ["name=x"])
    assert load_config([], ["name=x", "train.script=t.py"]).train.max_steps is None  # scripts decide their end


def make_run(tmp_path) -> Run:
    cfg = load_config([], ["name=x", f"run_dir={tmp_path}", "train.loop=a.b:c"])
    return Run(cfg, from_environ({}), torch.device("cpu"), checkpointer=None, stop=None)


def test_the_run_object_says_what_was_used_out_of_order(tmp_path) -> None:
    run = make_run(tmp_path)
    with pytest.raises(RunUsageError, match=r"before run.resume\(\)"):
        run.boundary(1)
    model = torch.nn.Linear(2, 1)
    counters = {"seen": 0}
    assert run.resume(model=model, counters=counters) == 0
    assert run.boundary(1) is False
    with pytest.raises(RunUsageError, match="got step 1 after step 1"):
        run.boundary(1)
    with pytest.raises(RunUsageError, match="has no state_dict"):
        make_run(tmp_path).resume(model=[1, 2])
    counters["seen"] = 5
    assert run.state()["counters"] == {"seen": 5} and run.state()["step"] == 1 and "weight" in run.state()["model"]


def test_finish_writes_the_model_and_done_last(tmp_path) -> None:
    run = make_run(tmp_path)
    run.resume(model=torch.nn.Linear(2, 1))
    run.boundary(1)
    done = run.finish(note="x")
    assert layout.done(tmp_path).exists() and layout.model(tmp_path).exists()
    assert done["step"] == 1 and done["note"] == "x" and len(done["params_sha256"]) == 64
    assert run.finish() is done  # idempotent: the session may call it again
