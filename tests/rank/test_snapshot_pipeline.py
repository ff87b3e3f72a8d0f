"""The device-to-host pipeline of snapshot writes (hpc_ddp/rank/state/pipeline.py), on the CPU.

The CUDA copier is a few lines of streams and events (tests/gpu/test_gpu.py runs it where a GPU is); what
can go wrong in between (chunking, the order of copies and writes, the overlap, the reuse of the host
memory, a copy that fails, the file on disk) is tested here through the seam, with a fake device copier that
copies in a thread of its own, in the order the copies were started, and records every call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.rank.state.copier import Chunk
from hpc_ddp.rank.state.pipeline import Pipeline
from hpc_ddp.rundir import slicing, snapshot
from hpc_ddp.rundir.snapshot import write as snapshot_write

CHUNK = 4096  # small chunks: every piece of a few KB is several


class FakeDevice:
    """A device copier for CPU tensors: each copy is done by a worker thread, in the order started, after
    ``gate(chunk)`` (fault injection: hold a copy back until the writer got somewhere), or, ``lazy``, only
    once the writer waits for it (anything that read the host memory before would read zeros); ``fail`` names
    the (piece, start) whose copy fails. ``fence``: :meth:`release` waits for every copy started, as the training
    stream waits for the side stream's event on a GPU. Every call goes into ``log``, in order."""

    pins = False

    def __init__(self, gate: Callable[[Chunk], None] | None = None, fail: tuple[int, int] | None = None,
                 fence: bool = False, lazy: bool = False) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.gate, self.fail, self.fence, self.lazy = gate, fail, fence, lazy
        self.started: list[threading.Event] = []
        self.jobs: queue.Queue[tuple[Chunk, threading.Event]] = queue.Queue()
        threading.Thread(target=self._copy, daemon=True).start()

    def boundary(self) -> None:
        self.log.append(("boundary",))

    def copy_async(self, chunk: Chunk) -> Any:
        done = threading.Event()
        self.log.append(("start", chunk.piece, chunk.start))
        self.started.append(done)
        if not self.lazy:
            self.jobs.put((chunk, done))
        return chunk, done

    def _copy(self) -> None:
        while True:
            chunk, done = self.jobs.get()
            if self.gate is not None:
                self.gate(chunk)
            chunk.dst.copy_(chunk.src)
            self.log.append(("done", chunk.piece, chunk.start))
            done.set()

    def release(self) -> None:
        self.log.append(("release",))
        if self.fence:
            assert all(done.wait(30) for done in self.started)

    def wait(self, handle: Any) -> None:
        chunk, done = handle
        if self.lazy and not done.is_set():  # the bytes arrive only now: a read before this reads zeros
            self.jobs.put((chunk, done))
        assert done.wait(30), "a copy never ended"
        if self.fail == (chunk.piece, chunk.start):
            raise RuntimeError("injected: the device lost this copy")
        self.log.append(("wait", chunk.piece, chunk.start))


def state_of_every_kind() -> dict[str, Any]:
    """Tensors of several dtypes and shapes: tied, empty, 0-dim, non-contiguous, and one cut over two slices."""
    torch.manual_seed(0)
    big = torch.randn(slicing.MIN_SPLIT // 4 + 1000)  # over MIN_SPLIT: cut between the two slices
    weight = torch.randn(40, 30)
    return {"model": {"weight": weight, "tied": weight, "half": torch.randn(50).to(torch.bfloat16),
                      "mask": torch.rand(33) > 0.5, "count": torch.tensor(7), "empty": torch.empty(0, 3),
                      "transposed": torch.randn(20, 10).t(), "big": big,
                      "conv": torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 64)}}}, "step": 4}


def node_file(directory: Path, state: dict[str, Any], node: int, stage: Callable[[dict[int, torch.Tensor]], Any]
              | None = None, nodes: int = 2) -> tuple[dict[str, Any], bytes]:
    """(manifest entry, bytes) of node ``node``'s file (of ``nodes``), written as a CPU state (``stage`` None)
    or staged."""
    rng = {node: {"torch": torch.ones(5, dtype=torch.uint8)}}
    content, split, _ = slicing.node_content(state, node, nodes, 1, rng, copy=stage is None)
    staged = stage(content["pieces"]) if stage is not None else None
    if staged is not None:
        content["pieces"] = staged.pieces
    try:
        entry = snapshot_write.write_node_file(directory, node, content, split=split,
                                         ready=staged.ready if staged is not None else None)
    finally:
        if staged is not None:
            staged.release()
    return entry, (directory / snapshot.node_file_name(node)).read_bytes()


@pytest.mark.parametrize("node", [0, 1])
def test_a_staged_node_file_is_byte_for_byte_the_one_a_cpu_state_gives(tmp_path: Path, node: int) -> None:
    """The format is unchanged: the same bytes and the same manifest entry (digests per slice included) as
    the path that writes CPU tensors as they are, whatever the dtypes, ties and views; and nothing reads a
    chunk before the writer waited for it (the lazy device copies it only then)."""
    state = state_of_every_kind()
    device = FakeDevice(lazy=True)
    pipeline = Pipeline(copier_of=lambda tensor: device, chunk=CHUNK)
    plain = node_file(tmp_path / "plain", state, node)
    staged = node_file(tmp_path / "staged", state, node, lambda pieces: pipeline.stage(pieces, copy_host=False))
    assert staged == plain
    assert len(plain[0]["digests"]["spans"]) >= 4, "the pieces were written from their own memory"
    assert [e for e in device.log if e[0] == "start"], "the pieces went through the device copier"


def test_each_chunk_is_written_after_its_copy_while_the_next_is_still_copying(tmp_path: Path) -> None:
    """The writer waits for chunk k alone: the fake device holds the copy of chunk k+1 back until the writer
    has taken chunk k (so a pipeline that waited for every copy before writing would never get there); and the
    copies run in the order the writer needs them."""
    log: list[tuple[Any, ...]] = []
    not_taken: list[tuple[int, int]] = []

    def after_the_writer_took_the_one_before(chunk: Chunk) -> None:
        starts = [e[1:] for e in log if e[0] == "start"]
        before = starts.index((chunk.piece, chunk.start)) - 1
        if before >= 0 and not _waits_for(log, starts[before]):
            not_taken.append((chunk.piece, chunk.start))

    device = FakeDevice(gate=after_the_writer_took_the_one_before)
    device.log = log
    pipeline = Pipeline(copier_of=lambda tensor: device, chunk=CHUNK)
    state = {"a": torch.randn(5 * CHUNK // 4), "b": torch.randn(3 * CHUNK // 4 + 7), "step": 1}
    node_file(tmp_path, state, 0, lambda pieces: pipeline.stage(pieces, copy_host=False), nodes=1)
    starts = [e[1:] for e in log if e[0] == "start"]
    waits = [e[1:] for e in log if e[0] == "wait"]
    assert len(starts) == 5 + 4 and waits == starts, "every chunk waited for once, in the order copied"
    assert not_taken == [], "chunk k+1's copy ends only once the writer took chunk k: it never did"
    for piece_start in starts:
        assert log.index(("done", *piece_start)) < log.index(("wait", *piece_start))
    assert log[0] == ("boundary",) and log.index(("release",)) > max(log.index(("start", *s)) for s in starts)


def _waits_for(log: list[tuple[Any, ...]], piece_start: tuple[int, int]) -> bool:
    """Whether the writer has taken that chunk: waits (bounded) until it has, False if it never does."""
    for _ in range(3000):
        if ("wait", *piece_start) in log:
            return True
        threading.Event().wait(0.01)
    return False


def test_the_host_memory_is_allocated_once_reused_and_grown_only_when_a_state_needs_more() -> None:
    device = FakeDevice()
    pipeline = Pipeline(copier_of=lambda tensor: device, chunk=CHUNK)
    small = {0: torch.randn(1000), 1: torch.randn(300)}
    for pieces in (small, small, {0: torch.randn(100)}):
        staged = pipeline.stage(pieces, copy_host=False)
        staged.release()
        assert pipeline.arena.allocations == 1
        assert all(torch.equal(staged.pieces[i], pieces[i]) for i in pieces)
    first = pipeline.arena.buffer
    staged = pipeline.stage({0: torch.randn(100_000)}, copy_host=False)
    staged.release()
    assert pipeline.arena.allocations == 2 and pipeline.arena.buffer is not first


def test_staging_again_before_the_last_write_released_its_memory_is_refused() -> None:
    pipeline = Pipeline(copier_of=lambda tensor: FakeDevice(), chunk=CHUNK)
    pipeline.stage({0: torch.randn(10)}, copy_host=False)
    with pytest.raises(RuntimeError, match="reused before its write released them"):
        pipeline.stage({0: torch.randn(10)}, copy_host=False)


def test_a_cpu_state_is_written_as_it_is_when_synchronous_and_copied_in_the_step_when_async() -> None:
    pipeline = Pipeline(chunk=CHUNK)  # the real routing: no CUDA tensor here
    live = {0: torch.randn(100), 1: torch.arange(10)}
    staged = pipeline.stage(live, copy_host=False)
    assert all(staged.pieces[i].data_ptr() == live[i].data_ptr() for i in live) and not staged.copying
    staged.release()
    assert pipeline.arena.allocations == 0
    staged = pipeline.stage(live, copy_host=True)
    live[0].add_(1)  # the training step goes on: the copy was made in the step
    assert not torch.equal(staged.pieces[0], live[0]) and not staged.copying
    staged.release()


@pytest.fixture
def checkpointer(tmp_path: Path) -> Iterator[Any]:
    """A real checkpointer of a world of one (gloo), writing in ``tmp_path/run``."""
    import torch.distributed as dist

    from hpc_ddp.core.config import SnapshotConfig
    from hpc_ddp.core.slurm_env import DistEnv
    from hpc_ddp.rank.state.checkpointer import Checkpointer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                  master_addr="127.0.0.1", master_port=1)
    try:
        yield Checkpointer(tmp_path / "run", SnapshotConfig(every_steps=None, every_minutes=None, keep_last=3), env,
                           "test")
    finally:
        dist.destroy_process_group()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def test_a_state_saved_through_the_pipeline_resumes_bit_identically_and_reuses_its_memory(checkpointer: Any) -> None:
    from hpc_ddp.rank.state.rng import capture_rng

    device = FakeDevice()
    checkpointer.pipeline = Pipeline(copier_of=lambda tensor: device, chunk=CHUNK)
    state = state_of_every_kind()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state["model"].items()}
    checkpointer.save(4, state, capture_rng())
    checkpointer.save(5, {**state, "step": 5}, capture_rng())
    assert checkpointer.pipeline.arena.allocations == 1, "the second snapshot reused the first one's memory"
    restored = checkpointer.restore()
    assert restored is not None and restored.step == 5
    assert _equal(restored.state["model"], expected) and _equal(restored.state["optimizer"], state["optimizer"])


def test_a_tensor_not_in_row_major_order_resumes_as_it_was(checkpointer: Any) -> None:
    """A channels_last or transposed tensor was written as its storage lies, and a resume put those bytes in
    the manifest's shape, scrambling it (a CPU state and a CUDA one alike): now written in row-major order."""
    from hpc_ddp.rank.state.rng import capture_rng

    model = {"conv": torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last), "t": torch.randn(20, 10).t()}
    checkpointer.save(1, {"model": model, "step": 1}, capture_rng())
    restored = checkpointer.restore()
    assert restored is not None and _equal(restored.state["model"], model)


def test_an_async_snapshot_holds_its_boundary_s_state_whatever_the_step_after_it_does(checkpointer: Any) -> None:
    """The training step right after the boundary changes every tensor; the snapshot still holds the state
    at the boundary: the fake device's release waits for its copies, as the training stream does on a GPU."""
    from hpc_ddp.rank.state.rng import capture_rng

    gate = threading.Event()
    device = FakeDevice(gate=lambda chunk: gate.wait(30), fence=True)
    checkpointer.pipeline = Pipeline(copier_of=lambda tensor: device, chunk=CHUNK)
    state = {"model": {"w": torch.randn(3000), "b": torch.randn(10)}, "step": 7}
    before = {k: v.clone() for k, v in state["model"].items()}
    threading.Timer(0.05, gate.set).start()  # the copies are slow: still running as the step goes on
    checkpointer.save_async(7, state, capture_rng())
    assert device.log.index(("release",)) > max(i for i, e in enumerate(device.log) if e[0] == "start")
    for tensor in state["model"].values():
        tensor.add_(1)  # the next step
    checkpointer.finish_async()
    restored = checkpointer.restore()
    assert restored is not None and restored.step == 7 and _equal(restored.state["model"], before)


def test_a_failed_copy_fails_the_snapshot_on_every_rank_and_leaves_the_memory_free(checkpointer: Any) -> None:
    from hpc_ddp.rank.state.rng import capture_rng

    device = FakeDevice(fail=(0, CHUNK))
    checkpointer.pipeline = Pipeline(copier_of=lambda tensor: device, chunk=CHUNK)
    state = {"model": {"w": torch.randn(3 * CHUNK // 4)}, "step": 2}
    with pytest.raises(snapshot.SnapshotError, match=r"not committed: .*copy of bytes 4096-8192 of snapshot piece 0"):
        checkpointer.save(2, state, capture_rng())
    assert snapshot.committed_steps(checkpointer.run_dir) == []
    assert not list(snapshot.step_dir(checkpointer.run_dir, 2).glob("*.tmp-*")), "no temporary file left"
    device.fail = None
    checkpointer.save(3, {**state, "step": 3}, capture_rng())  # the memory was released: the next one goes through
    assert snapshot.committed_steps(checkpointer.run_dir) == [3]


def test_a_staged_piece_the_stream_did_not_write_from_its_memory_is_an_error_not_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Were a piece written from elsewhere than its staged memory, its bytes would have gone out without
    waiting for their copy: refused (it cannot happen with torch.save of CPU tensors; the check stays)."""
    pipeline = Pipeline(copier_of=lambda tensor: FakeDevice(), chunk=CHUNK)
    monkeypatch.setattr(snapshot_write, "_address", lambda view: -1)
    with pytest.raises(snapshot.SnapshotError, match=r"pieces \[0\] .* were not written from their staged memory"):
        node_file(tmp_path, {"w": torch.randn(100), "step": 1}, 0, lambda p: pipeline.stage(p, copy_host=False),
                  nodes=1)
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob(".*.tmp-*"))
