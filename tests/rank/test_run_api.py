"""Units of the public run API: the sampler's position, loading a loop function, the program keys,
and the run object's rules (no process group needed: no checkpointer, no stop flag)."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import DataLoader

from hpc_ddp.rank.state.restore import load_per_rank
from hpc_ddp.rundir import layout
from hpc_ddp.core.config import load_config
from hpc_ddp.core.errors import ConfigError, UsageError
from hpc_ddp.rank.loop.run import Run
from hpc_ddp.rank.state.tracked import RunUsageError
from hpc_ddp.rank.loop.sampler import ShardSampler
from hpc_ddp.core.slurm_env import from_environ
from hpc_ddp.rank.loop.task import TaskError, load_loop


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
    with pytest.raises(RunUsageError, match=r"got step '2' \(a str, not an int\) after step 1"):
        run.boundary("2")  # type: ignore[arg-type]
    with pytest.raises(RunUsageError, match="has no state_dict"):
        make_run(tmp_path).resume(model=[1, 2])
    counters["seen"] = 5
    assert run.state()["counters"] == {"seen": 5} and run.state()["step"] == 1 and "weight" in run.state()["model"]


def test_finish_writes_the_model_and_keeps_the_done_record_for_the_session(tmp_path) -> None:
    """DONE.json comes last, after the ledger's finished line: the session writes it from run.finished
    (tests/rehearsal/test_local_training.py watches the order in a real run)."""
    run = make_run(tmp_path)
    run.resume(model=torch.nn.Linear(2, 1))
    run.boundary(1)
    done = run.finish(note="x")
    assert layout.model(tmp_path).exists() and not layout.done(tmp_path).exists() and run.finished is done
    assert done["step"] == 1 and done["note"] == "x" and len(done["params_sha256"]) == 64
    assert run.finish() is done  # idempotent: the session may call it again


def test_log_metrics_takes_one_element_tensors_and_numpy_scalars_and_names_the_key_of_anything_else(tmp_path) -> None:
    import json

    import numpy as np

    run = make_run(tmp_path)
    run.resume()
    loss = torch.tensor(0.25, requires_grad=True) * 2
    run.log_metrics(1, loss=loss, lr=np.float32(0.5), tokens=np.int64(7), note="warmup")
    row = json.loads(layout.metrics(tmp_path).read_text())
    assert (row["loss"], row["lr"], row["tokens"], row["note"]) == (0.5, 0.5, 7, "warmup")
    with pytest.raises(UsageError, match=r"grads=\.\.\.\) got a Tensor of shape \(3,\)") as err:
        run.log_metrics(2, grads=torch.ones(3))
    assert err.value.key == "grads" and "HINT" in str(err.value)


def test_a_tracked_sampler_iterated_outside_iterate_warns_once(tmp_path, caplog) -> None:
    sampler = ShardSampler(8, 0, 1)
    loader = DataLoader(list(range(8)), batch_size=2, sampler=sampler)
    taken(sampler, loader, 2)  # before it is tracked: the Trainer iterates its own sampler directly
    make_run(tmp_path).resume(sampler=sampler)
    taken(sampler, loader, 5)
    assert not [r for r in caplog.records if "outside sampler.iterate" in r.message]
    for _ in range(2):
        list(loader)
    warned = [r for r in caplog.records if "outside sampler.iterate" in r.message]
    assert len(warned) == 1 and "replays the epoch" in warned[0].message


def test_per_rank_refuses_what_it_cannot_keep_per_rank() -> None:
    import hpc_ddp

    model = torch.nn.Linear(2, 1)
    with pytest.raises(RunUsageError, match="elastic='later'"):
        hpc_ddp.per_rank({}, elastic="later")
    with pytest.raises(RunUsageError, match="has no state_dict"):
        hpc_ddp.per_rank([1, 2])
    assert hpc_ddp.per_rank(torch.Generator()).elastic == "refuse" and hpc_ddp.per_rank(model).obj is model


def test_per_rank_takes_a_mirror_policy_and_derive_is_never_sent() -> None:
    """Issue 59: ``mirror="derive"`` keeps an object out of what a buddy keeps; a policy it does not know is an
    error that names both it takes."""
    import hpc_ddp
    from hpc_ddp.rank.state.tracked import mirrored

    with pytest.raises(RunUsageError, match="mirror='every_n'") as err:
        hpc_ddp.per_rank({}, mirror="every_n")
    assert "'every_step' or 'derive'" in str(err.value)
    with pytest.raises(RunUsageError, match="did you mean mirror='derive'"):  # the newcomer's typo
        hpc_ddp.per_rank({}, mirror="derived")
    objects = {"batch": hpc_ddp.per_rank({}, mirror="derive"), "counter": hpc_ddp.per_rank({"n": 1})}
    assert objects["counter"].mirror == "every_step" and list(mirrored(objects)) == ["counter"]


def test_per_rank_takes_a_cadence_and_a_ranks_objects_travel_at_the_smallest() -> None:
    """``mirror=N`` sends an object about every N steps; a rank's kept objects go together, at the smallest
    cadence ("every_step" is 1); a cadence below 1, or a bool, is refused with what it takes."""
    import hpc_ddp
    from hpc_ddp.rank.state.tracked import cadence

    for bad, says in ((0, "a cadence of 1 step or more"), (True, "or a number of steps (mirror=10)")):
        with pytest.raises(RunUsageError, match=re.escape(says)):
            hpc_ddp.per_rank({}, mirror=bad)
    with pytest.raises(RunUsageError, match=re.escape("did you mean mirror=10 (a number, not a string)?")):
        hpc_ddp.per_rank({}, mirror="10")  # from a config file or the command line, unconverted
    every = {"batch": hpc_ddp.per_rank({}, mirror=50), "rng": hpc_ddp.per_rank({}, mirror=10)}
    assert cadence(every) == 10 and cadence({**every, "n": hpc_ddp.per_rank({})}) == 1
    assert cadence({"batch": hpc_ddp.per_rank({}, mirror="derive")}) == 0 and cadence({}) == 0


def test_a_derive_object_missing_from_a_snapshot_keeps_the_value_the_loop_built(tmp_path) -> None:
    """What the survivors' snapshot lacks (it never holds a ``mirror="derive"`` object) is the loop's to rebuild:
    the resume keeps the built value and the attempt's advice (its ledger note) says so; a mirrored object missing
    the same way is still refused."""
    import torch.distributed as dist

    import hpc_ddp
    from hpc_ddp.rank.state.snapshot_load import Restored
    from hpc_ddp.rank.state.tracked import pack

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        restored = Restored(step=7, state={"step": 7}, rng=None, config=None, world_size=1)
        built, counter = {"x": torch.ones(2)}, {"n": 0}
        run = make_run(tmp_path)
        run.per_rank = {"batch": hpc_ddp.per_rank(built, mirror="derive"), "counter": hpc_ddp.per_rank(counter)}
        load_per_rank(run, pack({"counter": {"n": 5}}), restored)
        assert counter["n"] == 5 and built["x"].tolist() == [1.0, 1.0]
        assert any("holds no batch (per_rank(..., mirror='derive'))" in f for f in run.advice.found), run.advice.found
        with pytest.raises(RunUsageError, match="has no per-rank state named 'counter'"):
            load_per_rank(run, pack({}), restored)
    finally:
        dist.destroy_process_group()


def test_per_rank_state_round_trips_through_its_bytes(tmp_path) -> None:
    import hpc_ddp
    from hpc_ddp.rank.state.tracked import load_into, pack, staged, unloadable, unpack

    generator, batch = torch.Generator().manual_seed(3), {"x": torch.arange(4.0)[1:], "n": 2}
    objects = {"g": hpc_ddp.per_rank(generator), "batch": hpc_ddp.per_rank(batch)}
    blob = pack(staged(objects))
    expected = torch.rand(3, generator=generator)
    batch.update(x=torch.zeros(1), n=0)
    saved = unpack(blob)
    load_into(generator, saved["g"])
    load_into(batch, saved["batch"])
    assert torch.equal(torch.rand(3, generator=generator), expected) and batch["n"] == 2
    assert batch["x"].tolist() == [1.0, 2.0, 3.0]
    assert "cannot load back" in unloadable({"odd": hpc_ddp.per_rank({"when": object()})})


def test_the_first_difference_names_the_key_and_the_ranks() -> None:
    from hpc_ddp.rank.state.replication import digests, first_difference

    same = {"w": torch.ones(100_000), "n": 3}
    other = {"w": torch.ones(100_000), "n": 4}
    assert digests(same) == digests({"n": 3, "w": torch.ones(100_000)})  # key order does not matter
    assert first_difference([digests(same), digests(same), digests(other)]) == ("n", [2])
    spread = torch.ones(100_000)
    spread[50_000:] = 2  # a large tensor is sampled, and a change over a range of it is seen
    assert first_difference([digests({"w": torch.ones(100_000)}), digests({"w": spread})]) == ("w", [1])


def test_per_rank_state_at_another_world_size_keeps_the_fresh_value_only_when_asked(tmp_path, caplog) -> None:
    """The restore side alone (a process group of one; the refusal on real ranks is in test_own_loop_state)."""
    import torch.distributed as dist

    import hpc_ddp
    from hpc_ddp.rank.state.snapshot_load import Restored

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        written_by_two = Restored(step=4, state={"step": 4}, rng=None, config=None, world_size=2)
        fresh = {"x": torch.ones(2)}
        run = make_run(tmp_path)
        run.per_rank = {"batch": hpc_ddp.per_rank(fresh, elastic="fresh")}
        load_per_rank(run, None, written_by_two)
        assert fresh["x"].tolist() == [1.0, 1.0] and "keeps the value this attempt built" in caplog.text
        run.per_rank = {"batch": hpc_ddp.per_rank(fresh)}
        with pytest.raises(RunUsageError, match="was written by 2 ranks and this attempt has 1") as err:
            load_per_rank(run, None, written_by_two)
        assert "elastic='fresh'" in str(err.value)
    finally:
        dist.destroy_process_group()


def test_a_garbage_per_rank_blob_at_resume_is_a_damaged_file_not_an_unpickling_error(tmp_path, caplog) -> None:
    """Issue 61: a per-rank blob that does not unpickle raised UnpicklingError on its rank alone, out of the
    collective the other ranks then wait in; it is now read as a damaged file (the same answer on every rank)."""
    import torch.distributed as dist

    import hpc_ddp
    from hpc_ddp.rank.state.snapshot_load import Restored

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        restored = Restored(step=4, state={"step": 4}, rng=None, config=None, world_size=1)
        fresh = {"x": torch.ones(2)}
        run = make_run(tmp_path)
        run.per_rank = {"batch": hpc_ddp.per_rank(fresh, elastic="fresh")}
        load_per_rank(run, b"\x80\x02garbage", restored)
        assert "per-rank state in the snapshot of step 4 cannot be read (UnpicklingError" in caplog.text
        run.per_rank = {"batch": hpc_ddp.per_rank(fresh)}
        with pytest.raises(RunUsageError, match="its node's file is damaged"):
            load_per_rank(run, b"not a pickle", restored)
    finally:
        dist.destroy_process_group()


def test_two_program_keys_get_a_hint_that_names_both() -> None:
    with pytest.raises(ConfigError, match=r"unset the other with train.loop=null or train.script=null"):
        load_config([], ["name=x", "train.loop=a.b:c", "train.script=t.py"])
    with pytest.raises(ConfigError, match="train.resume_args is set but train.script is not"):
        load_config([], ["name=x", "train.loop=a.b:c", "train.resume_args=[--resume]"])


def test_torchs_distributed_sampler_is_refused_naming_the_one_that_keeps_its_position(tmp_path) -> None:
    from torch.utils.data import DistributedSampler

    with pytest.raises(RunUsageError, match="got torch's DistributedSampler, which keeps no position") as err:
        make_run(tmp_path).resume(sampler=DistributedSampler(list(range(8)), num_replicas=1, rank=0))
    assert "hpc_ddp.ShardSampler(" in str(err.value) and "sampler.iterate(loader)" in str(err.value)
    assert isinstance(err.value, UsageError) and err.value.key == "sampler"  # exit 2, never requeued
