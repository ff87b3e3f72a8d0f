"""The GPU tier: what only a GPU can show (NCCL, CUDA RNG restore, pinned staging, bf16 on CUDA).

Skipped, with the reason, on a machine without CUDA (CI's has none); run on a lent GPU with
``python -m pytest tests/gpu -q``. The own-loop example (dropout, bf16 autocast, grad_accum 2,
a DataLoader worker, async snapshots) is stopped twice at world size 1 on NCCL and must end
bit-identical to an uninterrupted run: every step's loss and the final params_sha256; two
uninterrupted runs are compared first, so a nondeterministic kernel fails as that, not as a
resume bug.

What one GPU cannot show: NCCL refuses two ranks on one device, so every NCCL test here runs at
world size 1, where no peer can wedge a communicator. A hang here is one rank stalled outside any
collective (the watchdog's path), and a crash ends the attempt whether the code aborts the
communicator or destroys it. Multi-rank failures (a peer dead inside a collective) are tested on
gloo (tests/rehearsal/test_faults.py: a crashing rank ends the job fast); a wedged NCCL communicator, and
abort instead of destroy, wait for a machine with two GPUs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.rundir.ledger import read_attempts

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this machine has none)")
ROOT = Path(__file__).resolve().parents[2]
OPTIONS = ["slurm.nodes=1", "slurm.tasks_per_node=1", "train.max_steps=30", "train.log_every=1", "train.amp=bf16",
           "train.num_workers=1", "snapshot.every_steps=5", "snapshot.async_write=true", "train.batch_size=32"]


def rehearse(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/own_loop_gpt.yaml", "--local",
                           *OPTIONS, f"run_dir={run_dir}", *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_own_loop_resumes_bit_exactly_on_nccl_with_cuda_rng_and_pinned_staging(tmp_path: Path) -> None:
    rehearse(tmp_path / "straight")
    rehearse(tmp_path / "again")
    assert losses(tmp_path / "again") == losses(tmp_path / "straight"), "two uninterrupted runs differ: the " \
        "comparison below would mean nothing (a nondeterministic CUDA kernel?)"
    stopped = rehearse(tmp_path / "stopped", "--preempt-at", "7", "--timeout-at", "16")
    log = stopped.stdout + stopped.stderr
    assert "backend nccl" in log and "device cuda:0" in log
    reasons = [attempt["reason"] for attempt in read_attempts(tmp_path / "stopped")]
    assert reasons == ["preemption", "timeout", "finished"]
    assert losses(tmp_path / "stopped") == losses(tmp_path / "straight")
    done = [json.loads((tmp_path / name / "DONE.json").read_text()) for name in ("stopped", "straight", "again")]
    assert done[0]["params_sha256"] == done[1]["params_sha256"] == done[2]["params_sha256"]


def test_cuda_rng_state_is_captured_and_restored() -> None:
    from hpc_ddp.rank.state.rng import capture_rng, restore_rng

    torch.cuda.manual_seed(3)
    state = capture_rng()
    first = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")
    restore_rng(state)
    assert "cuda" in state and torch.equal(torch.rand(4, device="cuda"), first)


def test_async_staging_of_cuda_tensors_is_pinned() -> None:
    from hpc_ddp.rank.state.checkpointer import stage

    staged = stage({"w": torch.ones(8, device="cuda")})
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned() and staged["w"].sum().item() == 8


def test_a_cuda_state_split_over_nodes_is_staged_pinned_and_comes_back_whole() -> None:
    """Split snapshots on CUDA: the parts of a cut tensor are views until staged, then pinned CPU copies."""
    from hpc_ddp.rundir import slicing
    from hpc_ddp.rank.state.checkpointer import stage

    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda"), "step": 3}
    skeleton, tensors = slicing.split(state)
    split = slicing.layout_for(tensors, 4, 2)
    staged = {}
    for node in range(4):
        pieces = stage(slicing.pieces_for(split, tensors, slicing.slices_of(node, 4, 2), copy=False))
        assert all(p.device.type == "cpu" and p.is_pinned() for p in pieces.values())
        staged.update(pieces)
    back = slicing.assemble(split, skeleton, staged)
    assert torch.equal(back["w"], state["w"].cpu()) and torch.equal(back["b"], state["b"].cpu()) and back["step"] == 3


def test_a_two_rank_cpu_snapshot_resumes_on_one_gpu_under_nccl(tmp_path: Path) -> None:
    """Elastic resume across backends: written by 2 gloo ranks on CPU, continued by 1 NCCL rank on cuda:0."""
    task = ["train.task=tests.tasks.elastic:IdsTask", "train.batch_size=2", "train.global_batch_size=16",
            "train.max_steps=40", "train.log_every=1", "slurm.max_timeouts=0"]

    def run(run_dir: Path, tasks: int, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "--local", "name=gpu_elastic", *task,
                               f"run_dir={run_dir}", "slurm.nodes=1", f"slurm.tasks_per_node={tasks}", *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)

    plain = run(tmp_path / "plain", 2, "dist.backend=gloo")
    assert plain.returncode == 0, plain.stderr[-3000:]
    run(tmp_path / "moved", 2, "dist.backend=gloo", "--timeout-at", "9")
    resumed = run(tmp_path / "moved", 1, "dist.backend=auto", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logs = "".join(p.read_text() for p in (tmp_path / "moved" / "logs").glob("*.log"))
    assert "backend nccl" in logs and "at another world size: written by 2 ranks" in logs
    expected, got = losses(tmp_path / "plain"), losses(tmp_path / "moved")
    assert sorted(got) == list(range(1, 41))
    for step, loss in expected.items():  # CUDA's kernels sum in another order than CPU's
        assert got[step] == pytest.approx(loss, rel=1e-3), f"step {step}"


@pytest.mark.parametrize("variant", ["own", "own-fp16", "trainer"])
def test_fifty_steps_on_nccl_never_sync_the_host_with_the_gpu(variant: str) -> None:
    """The per-step protocol (the stop agreement on the CPU control group) never waits for the GPU: an own loop
    with the run API, and the Trainer between two of its log steps."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "sync_free_loop.py"), variant], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"no sync in 50 steps ({variant})" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]


def _faulty(run_dir: Path, fault: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "hpc_ddp.submit", "examples/mlp.yaml", "--local", "slurm.nodes=1",
                           "slurm.tasks_per_node=1", "train.task=tests.tasks:Faulty", "train.max_steps=40",
                           "snapshot.every_steps=5", "dist.timeout_s=10", "slurm.max_restarts_in_job=0",
                           f"run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HPC_DDP_TEST_FAULT": fault})


def test_a_rank_stalled_outside_any_collective_on_nccl_is_recorded_hung_with_the_flight_record(
        tmp_path: Path) -> None:
    """World size 1: the watchdog (no peer) sees the stall; the NCCL flight recorder's dump names DDP's all_reduce."""
    proc = _faulty(tmp_path / "hang", "sleep:0:7")  # exit 4, reason hung: the watchdog ended it, not a time limit
    assert proc.returncode == 4, proc.stderr[-3000:]
    [attempt] = read_attempts(tmp_path / "hang")  # the ledger's reader: an 'amends' line joins its attempt
    assert attempt["reason"] == "hung" and attempt["collectives"]
    from hpc_ddp.rundir import flight

    record = flight.read(str(tmp_path / "hang" / attempt["collectives"]))[0]  # node 0's file holds rank 0's
    names = {e.get("profiling_name") for e in record["entries"]}
    assert any(str(n).startswith("nccl:") for n in names), names  # DDP's gradient all_reduce on NCCL


def test_a_crash_on_nccl_at_world_size_one_is_recorded_failed_and_ends_at_once(tmp_path: Path) -> None:
    """World size 1 cannot tell abort from destroy (no peer can wedge the communicator): it shows the error path
    runs on NCCL and the attempt is recorded; abort instead of destroy needs a peer, so two GPUs."""
    proc = _faulty(tmp_path / "crash", "raise:0:7")  # dist.timeout_s=10: no watchdog verdict, reason failed
    assert proc.returncode not in (0, None), proc.stderr[-3000:]
    [attempt] = read_attempts(tmp_path / "crash")
    assert attempt["reason"] == "failed"


def test_the_replication_fingerprint_of_a_cuda_state_is_its_cpu_copys() -> None:
    """On a GPU every tensor of the device is summed by one fused reduction and read back in one copy: each leaf's
    digest is the one the per-leaf CPU path gives for the same bytes, and a change in a tensor's tail shows."""
    from hpc_ddp.rank.state.replication import fingerprints

    state = {"w": torch.randn(20_479, device="cuda"), "b": torch.randn(7, device="cuda"),
             "e": torch.randn(300, 70, device="cuda").to(torch.bfloat16), "step": 3}
    on_cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    assert fingerprints({"m": state}, 10) == fingerprints({"m": on_cpu}, 10)
    state["w"][-1] += 1
    assert fingerprints({"m": state}, 10) != fingerprints({"m": on_cpu}, 10)


def _mirror_rank(environ: dict[str, str], out: object) -> None:
    """Two gloo ranks on one GPU (NCCL refuses two ranks on one device): per-rank state holding a CUDA tensor is
    copied at each boundary into a pinned message, without the training thread waiting for the GPU (the sync
    debug mode would raise), and sent to the buddy once the copy is done; rank 1 dies once step 5's has left."""
    import os
    import signal

    os.environ.update(environ)
    import torch.distributed as dist

    from hpc_ddp.core.slurm_env import from_environ
    from hpc_ddp.rank.group import control
    from hpc_ddp.rank.salvage.mirror import Mirror
    from hpc_ddp.rank.state.tracked import PerRank, staged, unpack

    env = from_environ(environ)
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    with control.lazily():
        group = dist.new_group(backend="gloo")
    mirror = Mirror(env.rank, env.local_world_size, env.world_size, group).start()
    state = {"batch": torch.zeros(256, 256, device="cuda")}
    synced = None
    try:
        for step in range(1, 9):
            state["batch"].add_(step * (env.rank + 1))  # on the GPU, asynchronously
            dist.all_reduce(torch.ones(1))
            torch.cuda.set_sync_debug_mode("error")
            try:
                mirror.mark(step, staged({"batch": PerRank(state)}, cuda=True))
            except RuntimeError as err:  # the training thread waited for the GPU
                synced = synced or str(err).splitlines()[0]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if env.rank == 1 and step == 5:
                mirror.wait_sent(step, 30)
                os.kill(os.getpid(), signal.SIGKILL)
    except RuntimeError:
        pass
    held = mirror.held()  # {rank: {step: bytes}}, newest first: the last two boundaries (issue 55)
    values = {r: [(s, unpack(b)["batch"]["batch"]) for s, b in states.items()] for r, states in held.items()}
    (step, value), *before = values[1 - env.rank]
    out.put((env.rank, step, value.device.type, float(value[0, 0]),  # type: ignore[attr-defined]
             [(s, float(v[0, 0])) for s, v in before], [(s, float(v[0, 0])) for s, v in values[env.rank]], synced))
    out.close()  # type: ignore[attr-defined]
    out.join_thread()  # type: ignore[attr-defined]
    os._exit(0)


def test_a_per_rank_cuda_tensor_reaches_the_buddy_whole_when_its_rank_dies() -> None:
    import multiprocessing

    from hpc_ddp.core.slurm_env import simulated_environ
    from hpc_ddp.rehearsal.local import free_port

    port, ctx = free_port(), multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_mirror_rank, args=({**e, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, out))
             for e in simulated_environ(2, 1, job_id=1)]
    for proc in procs:
        proc.start()
    rank, step, device, value, before, own, synced = out.get(timeout=120)
    for proc in procs:
        proc.join(timeout=30)
    assert (rank, step, device) == (0, 5, "cpu")  # rank 1's state of step 5, a CPU copy
    assert value == 2 * sum(range(1, 6))  # every asynchronous add of rank 1 up to step 5 is in it
    # the message before (step 4 unless a state was replaced on its way) and rank 0's own last two, exactly
    assert len(before) == 1 and before[0][0] < 5 and before[0][1] == 2 * sum(range(1, before[0][0] + 1)), before
    assert own == [(5, sum(range(1, 6))), (4, sum(range(1, 5)))], own
    assert synced is None, f"mark waited for the GPU: {synced}"


def test_a_step_whose_work_the_gpu_has_not_finished_is_not_held_and_saying_so_does_not_wait() -> None:
    """On NCCL the host runs ahead of the device: a survivor's CPU can pass run.boundary(k) while the GPU never
    finished step k's all-reduce. A stream held busy by a long kernel stands in for the wedged all-reduce: the
    rank holds the boundary before (no update began after it), says so at once without waiting (a wait would sit
    the whole kernel out), and holds the newer step once the device has finished it."""
    from hpc_ddp.rank.salvage.held import Held

    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    held = Held({"model": model, "optimizer": optimizer})
    held.mark(1)
    torch.cuda.synchronize()
    assert held.whole()[0] == 1  # type: ignore[index]
    torch.cuda._sleep(5_000_000_000)  # seconds of a busy stream on any current GPU
    held.mark(2)
    assert held.whole()[0] == 1  # type: ignore[index]  # step 2's copies are behind the kernel; 1 is whole
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    optimizer.step()  # queued: its pre-update event behind the kernel too
    assert held.whole()[0] == 1  # type: ignore[index]  # the update's kernels have not run
    assert not held.marks[-1].event.query()  # said while the kernel still ran: nothing waited for it
    torch.cuda.synchronize()
    said = held.whole()
    assert isinstance(said, str) and "update of step 3" in said  # the device ran the update: neither is held


def test_a_survivor_writes_step_k_bit_for_bit_while_the_update_stream_is_wedged(tmp_path: Path) -> None:
    """Issue 58's survivor at world size 1: a long torch.cuda._sleep on the update stream stands where DDP's
    all-reduce is (after backward, before the optimizer), and the host goes on to optimizer.step() and
    run.boundary(k+1) as it does on NCCL. The survivor holds step k, copies it to the host on its own stream, and
    writes it; the file equals a clean save of step k bit for bit (Adam's CPU step counters included, which the
    host had advanced), and the write finished while the stream was still busy."""
    from hpc_ddp.rank.salvage import device_read
    from hpc_ddp.rank.salvage.held import Held
    from hpc_ddp.rank.salvage.jit import _on_host

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 256)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    position = {"sample": 0}
    held = Held({"model": model, "optimizer": optimizer, "scaler": scaler, "position": position})
    held.reader = device_read.CudaReader()
    x = torch.randn(64, 256, device="cuda")

    def forward_backward() -> None:
        position["sample"] += 64
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()

    for step in (1, 2, 3):
        forward_backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        held.mark(step)
    torch.cuda.synchronize()
    clean = _on_cpu(held.to_numbers(held.whole()[1]))  # type: ignore[index]  # step 3, the device idle
    forward_backward()
    torch.cuda._sleep(20_000_000_000)  # the wedged all-reduce of step 4's gradients: about 10 s
    wedge = torch.cuda.Event()
    wedge.record()
    optimizer.step()  # the host runs ahead: its counters advance now, its kernels wait behind the wedge
    optimizer.zero_grad(set_to_none=True)
    held.mark(4)
    step, state, holding = held.whole()  # type: ignore[misc]
    read = _on_host(held, step, state, holding)
    assert not isinstance(read, str), read
    path = tmp_path / "survivor.pt"
    torch.save(read[1], path)
    assert not wedge.query(), "the survivor's read or write waited for the wedged stream"
    torch.cuda.synchronize()
    assert step == 3 and _same(clean, torch.load(path, weights_only=True))


def test_the_per_step_protocol_at_world_size_two_never_syncs_the_host_with_the_gpu(tmp_path: Path) -> None:
    """Issue 58, Why 5: two ranks on the one GPU (gloo for the group, the model with BatchNorm and a per-rank
    prefetched batch on the GPU), every boundary after the first under the sync debug mode: the stop agreement, the
    two-level groups, the buffer broadcast and the mirror never make the training thread wait for the GPU
    (tests/gpu/sync_free_pair.py)."""
    from tests.gpu import sync_free_pair
    from tests.helpers import spawn_ranks

    results = spawn_ranks(sync_free_pair.rank_main, 2, 1, str(tmp_path / "run"), timeout=300)
    for rank, syncs, synced, sent, ward in results:
        assert syncs == [], f"rank {rank} synced with the GPU in run.boundary:\n" + "\n".join(syncs[:3])
        assert synced and sent == sync_free_pair.STEPS
        assert ward == [sync_free_pair.STEPS - 1, sync_free_pair.STEPS], (rank, ward)


@pytest.fixture
def checkpointer(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real checkpointer of a world of one (gloo for the control messages), writing in ``tmp_path/run``."""
    import torch.distributed as dist

    from hpc_ddp.core.config import SnapshotConfig
    from hpc_ddp.core.slurm_env import DistEnv
    from hpc_ddp.rank.state.checkpointer import Checkpointer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                  master_addr="127.0.0.1", master_port=1)
    try:
        yield Checkpointer(tmp_path / "run", SnapshotConfig(every_steps=None, every_minutes=None, keep_last=3), env,
                           "gpu")
    finally:
        dist.destroy_process_group()


def _cuda_state() -> dict[str, object]:
    """Model + Adam on the GPU, with a bf16 tensor, a channels_last one and a tensor cut in pieces."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    optimizer.step()
    extra = {"half": torch.randn(4096, device="cuda").to(torch.bfloat16),
             "conv": torch.randn(64, 32, 3, 3, device="cuda").to(memory_format=torch.channels_last),
             "big": torch.randn(3 << 20, device="cuda")}
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": extra, "step": 1}


def _on_cpu(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_a_cuda_state_goes_through_the_pipeline_into_reused_pinned_memory_and_resumes_bit_identically(
        checkpointer) -> None:  # type: ignore[no-untyped-def]
    """Synchronous snapshots of a CUDA state: copied on a side stream into pinned memory allocated once (the
    second snapshot reuses it), every piece written from there (each slice gets its digest), and the resume
    gives the very bytes back."""
    from hpc_ddp.rank.state.copier import CudaCopier
    from hpc_ddp.rank.state.rng import capture_rng
    from hpc_ddp.rundir import snapshot
    from hpc_ddp.rundir.snapshot import steps as snapshot_steps

    state = _cuda_state()
    expected = _on_cpu(state)
    checkpointer.save(1, state, capture_rng())
    arena = checkpointer.pipeline.arena
    buffer = arena.buffer
    checkpointer.save(2, {**state, "step": 2}, capture_rng())
    assert arena.allocations == 1 and arena.buffer is buffer and arena.pinned and buffer.is_pinned()
    staged = checkpointer.pipeline._last
    assert staged.copying and all(p.is_pinned() for p in staged.pieces.values() if p.nbytes)
    [copier] = checkpointer.pipeline._copiers.values()
    assert isinstance(copier, CudaCopier) and copier.stream != torch.cuda.current_stream()
    manifest = snapshot_steps.read_manifest(snapshot.step_dir(checkpointer.run_dir, 2))
    assert manifest is not None and manifest["files"]["node-00000.pt"]["digests"]["slices"]
    restored = checkpointer.restore()
    assert restored is not None and restored.step == 2
    assert _same({**expected, "step": 2}, restored.state)  # type: ignore[dict-item]


def test_an_async_snapshot_of_a_cuda_state_does_not_wait_for_the_gpu_and_holds_its_boundary_s_state(
        checkpointer) -> None:  # type: ignore[no-untyped-def]
    """The training stream is still busy with the step (a long kernel) when save_async returns: the host did
    not wait for the GPU. The next step changes every tensor at once, on the training stream; the copies read
    the state of the boundary all the same (the side stream waits for the boundary's event, the training
    stream for the copies' event)."""
    from hpc_ddp.rank.state.rng import capture_rng

    state = {"model": {f"w{i}": torch.randn(16 << 20, device="cuda") for i in range(4)}, "step": 1}
    checkpointer.save_async(1, state, capture_rng())  # the first one allocates the pinned memory
    checkpointer.finish_async()
    expected = _on_cpu(state["model"])
    rng = capture_rng()
    torch.cuda._sleep(2_000_000_000)  # the step's last kernels, still running on the training stream
    checkpointer.save_async(2, {**state, "step": 2}, rng)
    returned_while_busy = not torch.cuda.current_stream().query()
    for tensor in state["model"].values():  # type: ignore[union-attr]
        tensor.add_(1)  # the next step, enqueued right after the boundary
    checkpointer.finish_async()
    assert returned_while_busy, "save_async waited for the GPU"
    assert checkpointer.pipeline.arena.allocations == 1
    restored = checkpointer.restore()
    assert restored is not None and restored.step == 2 and _same(expected, restored.state["model"])
    assert not any(torch.equal(expected[k], v.cpu()) for k, v in state["model"].items())  # type: ignore[index,union-attr]


def test_the_health_checks_gpu_parts_run_on_the_device_and_touch_no_random_stream() -> None:
    """Issue 60's health check on a GPU: the memory test reads every pattern back whole at a rate, a stuck bit
    injected through its write seam is counted, and the matmul measures; no CUDA random stream moves."""
    from hpc_ddp.rank.attempt.health import matmul_gflops
    from hpc_ddp.rank.attempt.health_memory import PATTERNS, SIZES, memory_test

    device = torch.device("cuda")
    before = torch.cuda.get_rng_state()
    rate, wrong = memory_test(device, SIZES["quick"])
    assert wrong == 0 and rate > 0, rate

    def stuck_bit(block: "torch.Tensor", pattern: int) -> None:
        block.fill_(pattern)
        block[12345] = pattern ^ 0x01

    assert memory_test(device, 1 << 20, write=stuck_bit)[1] == len(PATTERNS)
    assert matmul_gflops(device) > 0
    assert torch.equal(torch.cuda.get_rng_state(), before)
