"""B3 and B4: snapshot throughput against torch.save and the disk, async blocking, load, stop latency."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import interleaved, median, quartiles, wall

ROOT = Path(__file__).resolve().parent.parent


def state_of(megabytes: float, device: str = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """Model + Adam state of about ``megabytes`` in total (parameters are a third of it), on ``device``."""
    width = int((megabytes / 3 * 2**20 / 4) ** 0.5)
    model = torch.nn.Linear(width, width, bias=False, device=device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.ones(1, width, device=device)).sum().backward()
    optimizer.step()
    return model, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": None,
                   "scaler": {}, "step": 1, "epoch": 0, "consumed": 0}


def _checkpointer(run_dir: Path) -> Any:
    import torch.distributed as dist

    from hpc_ddp.rank.state.checkpointer import Checkpointer
    from hpc_ddp.core.config import SnapshotConfig
    from hpc_ddp.core.slurm_env import DistEnv

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                  master_addr="127.0.0.1", master_port=1)
    return Checkpointer(run_dir, SnapshotConfig(every_steps=None, every_minutes=None, keep_last=1), env, "bench")


def _sync_saver(run_dir: Path, state: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(a checkpointer in a fresh ``run_dir``, its step counter, a timed sync save of ``state`` at the next step)."""
    from hpc_ddp.rank.state.rng import capture_rng

    shutil.rmtree(run_dir, ignore_errors=True)
    ckpt = _checkpointer(run_dir)
    counter = iter(range(1, 10**6))

    def sync() -> float:
        start = time.perf_counter()
        ckpt.save(next(counter), state, capture_rng())
        return time.perf_counter() - start
    return ckpt, counter, sync


def snapshot_figures(megabytes: float, directory: Path, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """Sync snapshot vs plain torch.save vs dd conv=fsync (MB/s); async blocked time; fresh-process load.
    ``device="cuda"``: the state lives on the GPU (B2-GPU), so each snapshot copies it to the host first."""
    from hpc_ddp.rank.state.rng import capture_rng

    model, state = state_of(megabytes, device)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    size_mb = buffer.getbuffer().nbytes / 2**20
    del buffer
    run_dir = directory / f"b3-{int(megabytes)}"
    ckpt, counter, sync = _sync_saver(run_dir, state)

    def plain() -> float:
        start = time.perf_counter()
        torch.save(state, directory / "plain.pt")
        took = time.perf_counter() - start
        os.sync()  # not timed: its dirty pages would otherwise be written back during the next figure
        return took

    def dd() -> float:
        count = max(1, int(size_mb / 4))
        return wall(["dd", "if=/dev/zero", f"of={directory / 'dd.bin'}", "bs=4M", f"count={count}",
                     "conv=fsync"]) * size_mb / (count * 4)

    def blocked() -> float:
        start = time.perf_counter()
        ckpt.save_async(next(counter), state, capture_rng())
        took = time.perf_counter() - start
        ckpt.finish_async()
        return took

    first = sync()  # the first large write and allocation of a process are slower (and on a GPU the first
    blocked()  # snapshot allocates the pinned memory every later one reuses): said apart, not in the medians
    samples = interleaved({"sync_s": sync, "plain_torch_save_s": plain, "dd_fsync_s": dd,
                           "async_blocked_s": blocked}, repeats)
    width = state["model"]["weight"].shape[0]
    load = [_fresh_load(run_dir, width) for _ in range(repeats)]
    medians = {name: median(values) for name, values in samples.items()}
    (directory / "plain.pt").unlink(missing_ok=True)
    (directory / "dd.bin").unlink(missing_ok=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"size_mb": round(size_mb, 1), **{k: round(v, 4) for k, v in medians.items()},
            "sync_mb_s": round(size_mb / medians["sync_s"], 1),
            "plain_mb_s": round(size_mb / medians["plain_torch_save_s"], 1),
            "dd_mb_s": round(size_mb / medians["dd_fsync_s"], 1),
            "sync_vs_dd": round(medians["dd_fsync_s"] / medians["sync_s"], 3),
            "async_blocked_vs_sync": round(medians["async_blocked_s"] / medians["sync_s"], 3),
            "load_mmap_s": round(median([x["mmap_s"] for x in load]), 4),
            "load_and_copy_s": round(median([x["copy_s"] for x in load]), 4), "first_sync_s": round(first, 4),
            "repeats": repeats}


def _fresh_load(run_dir: Path, width: int) -> dict[str, float]:
    """Load the newest snapshot in a new process (torch imported first, not timed), as a resumed attempt
    does; not verified (sha256 is timed by the resume figure of B7)."""
    code = ("import json, sys, time, torch\nfrom hpc_ddp import snapshot\n"
            "width = int(sys.argv[2])\n"  # the model and optimizer exist before a resume loads into them
            "model = torch.nn.Linear(width, width, bias=False); opt = torch.optim.Adam(model.parameters())\n"
            "trust = lambda d, m: {n: None for n in m['files']}\n"
            "t0 = time.perf_counter(); state = snapshot.read_state(snapshot.choose("
            "__import__('pathlib').Path(sys.argv[1]), verify=trust))[0]\n"
            "t1 = time.perf_counter(); model.load_state_dict(state['model'])\n"
            "opt.load_state_dict(state['optimizer'])\n"
            "t2 = time.perf_counter(); print(json.dumps({'mmap_s': t1 - t0, 'copy_s': t2 - t0}))")
    out = subprocess.run([sys.executable, "-c", code, str(run_dir), str(width)], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class _Clock(io.StringIO):
    """The launcher's stderr: notes when it sent the injected signal."""

    sent_at: float | None = None

    def write(self, text: str) -> int:
        if "sending" in text and self.sent_at is None:
            self.sent_at = time.perf_counter()
        return super().write(text)


def sync_write_probe(run_dir: Path, megabytes: float) -> Callable[[], float]:
    """A timed sync snapshot of ~megabytes of model + Adam state, warmed up (a process's first large write is
    slower): B4's reference, measured beside each stop in the same invocation."""
    _, state = state_of(megabytes)
    _, _, sync = _sync_saver(run_dir, state)
    sync()
    return sync


def stop_latency(directory: Path, megabytes: float, repeats: int,
                 write_probe: Callable[[], float]) -> dict[str, Any]:
    """B4: one rank with ~megabytes of state gets SIGTERM; time to the commit and to the exit; steps lost.
    Before each stop, ``write_probe`` times a sync snapshot of the same size: the reference, side by side."""
    from hpc_ddp.rundir import snapshot
    from hpc_ddp.core.config import load_config, save_config
    from hpc_ddp.rehearsal.local import launch
    from hpc_ddp.rundir.ledger import read_attempts

    results = []
    for i in range(repeats):
        run_dir = directory / f"b4-{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = load_config([], ["name=b4", f"run_dir={run_dir}", "train.task=benchmarks.tasks:BigTask",
                               "train.max_steps=100000", "train.batch_size=16", "train.log_every=1000",
                               "snapshot.every_minutes=null"])
        path = save_config(cfg, run_dir / "config.yaml")
        write_s = write_probe()
        clock = _Clock()
        os.environ["HPC_DDP_BENCH_MB"] = str(megabytes)
        code = launch(path, run_dir, 1, 1, job_id=1, events=[(20, int(signal.SIGTERM))], stream=io.StringIO(),
                      err=clock)
        exited = time.perf_counter()
        step = snapshot.committed_steps(run_dir)[0]
        manifest = snapshot.step_dir(run_dir, step) / snapshot.MANIFEST
        node_file = snapshot.step_dir(run_dir, step) / "node-00000.pt"
        committed_wall = manifest.stat().st_mtime
        last = read_attempts(run_dir)[-1]
        results.append({"exit_code": code, "signal_to_exit_s": exited - (clock.sent_at or exited),
                        "commit_to_exit_s": time.time() - committed_wall - (time.perf_counter() - exited),
                        "steps_lost": last["last_step"] - step, "steps_after_signal": last["last_step"] - 20,
                        "size_mb": node_file.stat().st_size / 2**20,
                        "sync_write_s": write_s})
        shutil.rmtree(run_dir, ignore_errors=True)
    return {key: round(median([r[key] for r in results]), 4) for key in results[0]} | {"repeats": repeats}


def gpt_state(device: str = "cpu") -> dict[str, Any]:
    """What a snapshot of examples/own_loop_gpt.py checks: the model, AdamW after a step, the sampler's position
    (run.state() of its tracked objects, the step left out as replication.check leaves it out), on ``device``."""
    from examples.char_gpt import BLOCK, TEXT, CharWindows
    from examples.own_loop_gpt import GPT
    from hpc_ddp.rank.loop.sampler import ShardSampler
    from hpc_ddp.rank.state.tracked import state_of

    torch.manual_seed(0)
    data = CharWindows(TEXT.read_text())
    model = GPT(len(data.vocab)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    inputs = torch.randint(len(data.vocab), (2, BLOCK), device=device)
    torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), inputs.flatten()).backward()
    optimizer.step()
    sampler = ShardSampler(len(data), 0, 1)
    return {name: state_of(obj) for name, obj in {"model": model, "optimizer": optimizer, "sampler": sampler}.items()}


def _check_vs_sync(name: str, state: dict[str, Any], directory: Path, rounds: int) -> dict[str, Any]:
    """The check's local work on ``state`` (its fingerprints, as replication.check makes them) against a sync
    snapshot of the same state, interleaved ``rounds`` times; the ratio's median and its quartiles over rounds."""
    from hpc_ddp.rank.state.replication import combined, fingerprints, leaves

    run_dir = directory / f"b8-{name}"
    _, _, sync = _sync_saver(run_dir, {**state, "step": 1})
    steps = iter(range(10, 10**9, 10))

    def fingerprint() -> float:
        start = time.perf_counter()
        [combined(items) for items in fingerprints(state, next(steps)).values()]
        return time.perf_counter() - start

    sync(), fingerprint()  # the first large write of a process is slower: not counted
    samples = interleaved({"sync_s": sync, "fingerprint_s": fingerprint}, rounds)
    shutil.rmtree(run_dir, ignore_errors=True)
    ratios = [f / s for f, s in zip(samples["fingerprint_s"], samples["sync_s"])]
    tensors = [leaf for _, leaf in leaves(state) if isinstance(leaf, torch.Tensor)]
    q1, q3 = quartiles(ratios)
    return {"leaves": len(list(leaves(state))), "tensors": len(tensors),
            "state_mb": round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 2),
            **{k: round(median(v), 5) for k, v in samples.items()},
            "fingerprint_vs_sync": round(median(ratios), 4), "ratio_iqr": [round(q1, 4), round(q3, 4)],
            "rounds": rounds}


def replication_figures(megabytes: float, directory: Path, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """B8: the replication check's local work (every replicated object fingerprinted, every element of every
    tensor read) against a sync snapshot of the same state: the GPT example's state, with its real leaf count
    (many small leaves: the per-leaf cost shows), and a ``megabytes`` model + Adam state of three large tensors
    (the bandwidth shows). Its collective is one all_reduce of 2 int64 per object, not timed here. With
    ``device="cuda"`` both states live on the GPU: the sums run there and one copy per device reaches the host
    (the sync snapshot copies the whole state to the host first)."""
    _, large = state_of(megabytes, device)
    large.pop("step")
    gpt = _check_vs_sync("gpt", gpt_state(device), directory, 10 * repeats)
    big = _check_vs_sync(f"{int(megabytes)}mb", large, directory, repeats)
    worst = max(gpt["fingerprint_vs_sync"], big["fingerprint_vs_sync"])
    return {"gpt": gpt, "large": big, "state_mb": megabytes, "target": "replication check <= 0.02 x a sync snapshot "
            "(median per-round ratio, each state)", "met": worst <= 0.02, "repeats": repeats, "device": device}
