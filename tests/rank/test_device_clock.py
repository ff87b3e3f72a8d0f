"""Which step a rank's device holds after a failure, decided with a stand-in device clock whose events complete,
stall or never come (rank/salvage/device_clock.py), and the one read of the held state on a stream of its own
(rank/salvage/device_read.py) with a stand-in reader. No GPU: the decisions are what is tested here; tests/gpu and
dev/gpu_check.sh run the same code on a device."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

from hpc_ddp.rank.salvage import device_read
from hpc_ddp.rank.salvage.device_clock import Mark, holding, intact
from hpc_ddp.rank.salvage.held import Held
from hpc_ddp.rank.salvage.jit import _on_host
from hpc_ddp.rank.state.pipeline import Pipeline


class Event:
    """A device event: done when the device reaches it (``done``), or never."""

    def __init__(self, done: bool) -> None:
        self.done = done


class Clock:
    """A device that runs behind the host: every event recorded from now on is done or not as ``running``
    says, until the test moves the device on (``reach``)."""

    device = True

    def __init__(self) -> None:
        self.running = True  # False: the stream is wedged, events recorded now stall
        self.recorded: list[Event] = []

    def record(self) -> Event:
        self.recorded.append(Event(self.running))
        return self.recorded[-1]

    def done(self, event: Event) -> bool:
        return event.done

    def reach(self) -> None:
        """The device catches up with the host: every event recorded so far completes."""
        for event in self.recorded:
            event.done = True


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()  # on a GPU: its kernels queued, its hooks' events recorded


def test_a_peer_lost_in_the_all_reduce_after_the_host_stepped_and_marked_leaves_the_step_before_held() -> None:
    """Why 1 of issue 58: the host called optimizer.step() for k+1 and even passed run.boundary(k+1) while the
    device is wedged in k+1's all-reduce. The memory still holds k, with k's copies (not k+1's position)."""
    model, optimizer = _model()
    position = {"sample": 0}
    clock = Clock()
    held = Held({"model": model, "optimizer": optimizer, "position": position}, clock=clock)
    held.mark(7)
    clock.running = False  # the all-reduce of step 8 wedges: everything recorded from here stalls
    position["sample"] += 8
    _train(model, optimizer)  # the host ran ahead: the update's kernels wait behind the wedge
    step, state, kept = held.whole()  # type: ignore[misc]
    assert (step, state["position"], kept.synced) == (7, {"sample": 0}, False)
    held.mark(8)  # and the host passed run.boundary(8)
    step, state, kept = held.whole()  # type: ignore[misc]
    assert step == 7 and state["position"] == {"sample": 0} and state["step"] == 7
    assert intact(kept.mark, clock)  # read now: the update of 8 had not begun on the device
    clock.reach()  # a false alarm: the wedge clears and the device runs the update after all
    assert not held.intact(kept.mark)  # the read is no longer step 7's: the write is not committed
    step, state, _ = held.whole()  # type: ignore[misc]
    assert step == 8 and state["position"] == {"sample": 8}


def test_an_update_the_device_began_and_did_not_finish_holds_neither_step_and_says_so() -> None:
    """A kill between the two events of one update (its pre-update event done, its post-update event never): the
    parameters are half-way, and the rank says why in its offer."""
    model, optimizer = _model()
    clock = Clock()
    held = Held({"model": model, "optimizer": optimizer}, clock=clock)
    held.mark(3)
    _train(model, optimizer)
    held.marks[-1].ended.done = False  # the device died inside the update
    said = held.whole()
    assert isinstance(said, str) and "had begun the update of step 4 and not finished it" in said
    held.marks[-1].ended.done = True  # finished on the device, but the host never reached the boundary
    said = held.whole()
    assert isinstance(said, str) and "run.boundary(4) had not come" in said


def test_a_boundary_whose_work_never_finished_with_no_boundary_before_it_holds_nothing() -> None:
    clock = Clock()
    clock.running = False
    model, optimizer = _model()
    held = Held({"model": model, "optimizer": optimizer}, clock=clock)
    held.mark(0)  # the resume's own mark, behind a wedged stream
    said = held.whole()
    assert isinstance(said, str) and "had not finished the work of step 0" in said
    assert "had not finished run.resume()" in str(holding([], clock))


def test_rank_0s_buffers_are_in_the_step_only_once_their_copies_after_the_broadcast_completed() -> None:
    """The event recorded in mark() covers the boundary's copies; synced() records its own after the broadcast of
    rank 0's buffers. A wedged broadcast leaves the step held with this rank's own buffers, said unsynced (the
    writer then defers to rank 0, rank/salvage/jit_checks.py)."""
    model, optimizer = _model()
    clock = Clock()
    held = Held({"model": model, "optimizer": optimizer}, clock=clock)
    held.mark(5)
    own = held.copies["model"]["1.running_mean"].clone()
    clock.running = False  # the broadcast of rank 0's buffers wedges
    with torch.no_grad():
        model[1].running_mean.fill_(9.0)  # what the broadcast brings
    held.synced()
    step, state, kept = held.whole()  # type: ignore[misc]
    assert step == 5 and not kept.synced and torch.equal(state["model"]["1.running_mean"], own)
    clock.reach()
    step, state, kept = held.whole()  # type: ignore[misc]
    assert kept.synced and torch.equal(state["model"]["1.running_mean"], torch.full((4,), 9.0))


def test_on_the_host_clock_an_update_begun_on_the_host_has_begun() -> None:
    """The CPU's rule is the host's order, unchanged: the older mark is not held once the update after it began."""
    model, optimizer = _model()
    held = Held({"model": model, "optimizer": optimizer})
    held.mark(1)
    _train(model, optimizer)
    held.mark(2)
    assert held.whole()[0] == 2  # type: ignore[index]
    _train(model, optimizer)
    said = held.whole()
    assert isinstance(said, str) and "optimizer had begun the update after step 2" in said
    assert len(held.marks) == 2 and [m.step for m in held.marks] == [1, 2]


def test_the_decision_never_takes_a_mark_older_than_an_update_that_began() -> None:
    clock = Clock()
    older = Mark(1, {}, Event(True), began=Event(True), ended=Event(True))
    newer = Mark(2, {}, Event(False))
    said = holding([older, newer], clock)
    assert isinstance(said, str) and "update of step 2" in said  # began and ended, its boundary's copies not done
    newer.event.done = True
    assert holding([older, newer], clock).step == 2  # type: ignore[union-attr]


Pair = namedtuple("Pair", "a b")


class Reader:
    """A stand-in device: tensors with ``requires_grad`` unset and more than one element are "on the device";
    copies complete when ``finish`` says so."""

    def __init__(self, finish: bool = True) -> None:
        self.finish = finish
        self.copied: list[tuple[torch.Tensor, torch.Tensor]] = []

    def moves(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() > 1

    def buffers(self, sizes: list[int]) -> list[torch.Tensor]:
        return [torch.empty(size, dtype=torch.uint8) for size in sizes]

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        for src, dst in pairs:
            dst.copy_(src)
        self.copied += pairs
        return "handle"

    def done(self, handle: Any) -> bool:
        return self.finish


def test_the_held_state_is_copied_once_to_host_memory_with_its_containers_kept() -> None:
    shared = torch.arange(6.0).reshape(2, 3)
    state = {"m": OrderedDict(w=shared, n=torch.tensor(1)), "p": Pair(shared, [torch.ones(3, dtype=torch.bfloat16)])}
    reader = Reader()
    out = device_read.to_host(state, reader)
    assert isinstance(out["m"], OrderedDict) and isinstance(out["p"], Pair)
    assert out["m"]["w"] is not shared and torch.equal(out["m"]["w"], shared)
    assert out["p"].a is out["m"]["w"]  # one copy per tensor object
    assert out["m"]["n"] is state["m"]["n"]  # not on the "device": as it was
    assert out["p"].b[0].dtype == torch.bfloat16 and torch.equal(out["p"].b[0], torch.ones(3, dtype=torch.bfloat16))
    assert len(reader.copied) == 2


def test_a_copy_that_never_completes_is_given_up_at_the_deadline_without_waiting_for_it() -> None:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    said = device_read.to_host({"w": torch.ones(4)}, Reader(finish=False), read_s=2.0, clock=lambda: now[0],
                               sleep=sleep)
    assert isinstance(said, str) and "did not finish within 2 s" in said and 2.0 <= now[0] < 2.1


def test_the_failure_path_reads_through_the_reader_and_refuses_a_read_the_update_overtook() -> None:
    model, optimizer = _model()
    clock = Clock()
    held = Held({"model": model, "optimizer": optimizer}, clock=clock)
    held.reader = Reader()
    held.mark(2)
    step, state, kept = held.whole()  # type: ignore[misc]
    read = _on_host(held, step, state, kept)
    assert not isinstance(read, str) and read[0] == 2
    assert read[1]["model"]["0.weight"] is not model[0].weight and torch.equal(read[1]["model"]["0.weight"],
                                                                               model[0].weight)
    kept.mark.began = Event(True)  # the update began on the device while the copy ran
    assert "began on this rank's device while its state was copied" in str(_on_host(held, step, state, kept))
    held.reader = Reader(finish=False)
    kept.mark.began = None
    device_read.READ_S, before = 0.05, device_read.READ_S
    try:
        assert "did not finish within" in str(_on_host(held, step, state, kept))
    finally:
        device_read.READ_S = before


@pytest.mark.parametrize("case", ["free", "busy", "small", "pageable"])
def test_the_read_borrows_the_snapshot_pipelines_pinned_arena_only_when_it_is_free_and_large_enough(case: str) -> None:
    """Nothing on the failure path allocates pinned memory: the pipeline's arena is lent when it is pinned, large
    enough and no write holds it (then never staged into again: the process ends after the failure path)."""
    pipeline = Pipeline()
    pipeline.arena.buffer = torch.zeros(8192 if case != "small" else 4096, dtype=torch.uint8)
    pipeline.arena.pinned = case != "pageable"  # a CPU machine cannot pin: the flag stands in
    if case == "busy":
        pipeline.stage({0: torch.ones(4)}, copy_host=True)
    regions = pipeline.borrow([4096, 100])
    if case != "free":
        assert regions is None
        return
    assert regions is not None and [len(r) for r in regions] == [4096, 100]
    with pytest.raises(RuntimeError, match="reused before"):
        pipeline.stage({0: torch.ones(4)}, copy_host=True)


def test_the_mirrors_held_states_leave_out_one_whose_gpu_copy_never_completes_instead_of_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Why 3 of issue 58: Mirror.held() synchronized on the events of its GPU copies; one enqueued behind a wedged
    collective hung the failure handler. Now each is queried for at most HELD_WAIT_S, and a state whose copy is not
    done is left out: the survivor still offers the one before."""
    import time

    from hpc_ddp.rank.salvage import mirror
    from hpc_ddp.rank.salvage.mirror_receive import Receiver
    from hpc_ddp.rank.salvage.mirror_send import Sender

    class Stalled:
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            raise AssertionError("synchronized on an event the failure path must only query")

    monkeypatch.setattr(mirror, "HELD_WAIT_S", 0.2)
    kept = object.__new__(mirror.Mirror)  # no process group: only the held states are asked for
    kept.rank, kept.ward, kept.broken = 0, 0, None
    kept._lock = mirror.threading.Lock()
    Sender.__init__(kept)
    Receiver.__init__(kept)
    kept.mark(4, {"batch": torch.arange(4)})
    kept.mark(5, {"batch": torch.arange(5)})
    kept.own.ready = [Stalled()]  # the copies of step 5 wait behind the wedge
    started = time.monotonic()
    held = kept.held()
    assert time.monotonic() - started < 2 and list(held[0]) == [4]


def test_the_optimizer_state_the_host_advances_at_once_is_held_as_it_was_when_the_update_began() -> None:
    """On a GPU model Adam's ``step`` counters are CPU tensors: ``optimizer.step()`` advances them on the host at
    once while the update's kernels wait behind the wedge. The held step k takes them as they were when the update
    of k+1 began (here every leaf is a CPU one: the stand-in device runs on the CPU), and a parameter with no state
    then has none in the held step."""
    import copy

    model, _ = _model()
    optimizer = torch.optim.AdamW(model[0].parameters(), lr=0.1)
    clock = Clock()
    held = Held({"model": model, "optimizer": optimizer}, clock=clock)
    for step in (1, 2, 3):
        _train(model, optimizer)
        held.mark(step)
    expected = copy.deepcopy(optimizer.state_dict())
    optimizer.add_param_group({"params": list(model[1].parameters()), "lr": 0.01})
    held.mark(3)  # the group is in the step's copies; its parameters have no state yet
    clock.running = False
    _train(model, optimizer)  # the host's update: counters to 4, the new group's state made
    assert float(optimizer.state_dict()["state"][0]["step"]) == 4.0 and 2 in optimizer.state_dict()["state"]
    step, state, _ = held.whole()  # type: ignore[misc]
    got = state["optimizer"]["state"]
    assert step == 3 and sorted(got) == sorted(expected["state"]) == [0, 1]
    assert all(torch.equal(got[i][k], expected["state"][i][k]) for i in got for k in got[i])
    assert float(got[0]["step"]) == 3.0


def test_the_gpu_checks_two_rank_script_runs_its_protocol_on_the_cpu(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/gpu/sync_free_pair.py runs once on a lent GPU, where its first run must be its last: its protocol
    (two nodes of one rank, BatchNorm broadcast at each boundary, a per-rank batch mirrored) is rehearsed here on
    the CPU, without the debug mode."""
    from tests.gpu import sync_free_pair
    from tests.helpers import spawn_ranks

    monkeypatch.setenv(sync_free_pair.DEVICE_VAR, "cpu")  # the spawned ranks inherit it
    results = spawn_ranks(sync_free_pair.rank_main, 2, 1, str(tmp_path / "run"), timeout=180)
    assert [r[0] for r in results] == [0, 1]
    for rank, syncs, synced, sent, ward in results:
        assert syncs == [] and synced and sent == sync_free_pair.STEPS, (rank, syncs, synced, sent)
        assert ward == [sync_free_pair.STEPS - 1, sync_free_pair.STEPS], (rank, ward)


def test_the_ranks_of_a_node_waiting_for_anothers_commit_read_newest_once_per_node_and_tenth_of_a_second(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 59: in single-writer mode every surviving rank polled snapshots/newest.json ten times a second for
    up to 10 s. Now the node's ranks share one read per tenth of a second (node-local memory)."""
    import threading
    import time
    from types import SimpleNamespace

    from hpc_ddp.rank.salvage import jit, jit_commit
    from hpc_ddp.rundir import jit_files, newest

    reads: list[float] = []
    real = newest.read

    def counted(run_dir: Any) -> Any:
        reads.append(time.monotonic())
        return real(run_dir)

    monkeypatch.setattr(newest, "read", counted)
    run = SimpleNamespace(run_dir=tmp_path)
    results: list[str] = []

    def rank(local: int) -> None:
        env = SimpleNamespace(job_id=5, restart_count=0, in_job=0, node_rank=0, local_rank=local, rank=local,
                              local_world_size=4, world_size=4, num_nodes=1)
        post = jit_files.post_for(tmp_path, env)
        results.append(jit_commit.claimed_by_another(tmp_path, 7, post.shared, {"rank": local}, wait_s=1.0,
                                                     read=jit._newest_per_node(run, post)))

    threads = [threading.Thread(target=rank, args=(local,)) for local in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == ["another survivor claimed step 7; not committed within 1 s"] * 4
    assert 5 <= len(reads) <= 14, len(reads)  # one a tenth of a second for the node, not 4 x 10
